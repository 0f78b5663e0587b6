"""`python -m labkit.labs.ddp`: the lab program (labkit.labs.ddp.lab)."""
from labkit.labs.ddp.lab import main

main()
