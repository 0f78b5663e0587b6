"""`python -m labkit.labs.pp`: the lab program (labkit.labs.pp.lab)."""
from labkit.labs.pp.lab import main

main()
