"""`python -m labkit.labs.ft`: the driver (labkit.labs.ft.lab)."""
from labkit.labs.ft.lab import main

main()
