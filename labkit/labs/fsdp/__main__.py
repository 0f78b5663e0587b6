"""`python -m labkit.labs.fsdp`: the lab program (labkit.labs.fsdp.lab)."""
from labkit.labs.fsdp.lab import main

main()
