"""`python -m labkit.labs.compile`: the lab program (labkit.labs.compile.lab)."""
from labkit.labs.compile.lab import main

main()
