"""`python -m labkit.labs.tp`: the lab program (labkit.labs.tp.lab)."""
from labkit.labs.tp.lab import main

main()
