"""`python -m labkit.labs.diagnose`: the lab program (labkit.labs.diagnose.lab)."""
from labkit.labs.diagnose.lab import main

main()
