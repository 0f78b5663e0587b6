"""`python -m labkit.labs.zero`: the lab program (labkit.labs.zero.lab)."""
from labkit.labs.zero.lab import main

main()
