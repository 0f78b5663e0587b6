"""`python -m labkit.labs.threed`: the lab program (labkit.labs.threed.lab)."""
from labkit.labs.threed.lab import main

main()
