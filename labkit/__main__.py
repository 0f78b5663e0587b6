"""`python -m labkit ...` is the same as the `labkit` command."""
from labkit.cli import main

raise SystemExit(main())
