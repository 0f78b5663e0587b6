"""Lab programs (layer 5): each runs inside ranks, `python -m labkit.labs.X` or
`run_lab("labkit.labs.X", nproc=N)`. Each reads top to bottom, with its launch lines in its
docstring and its parameters as flags; it compares the hand-built version with PyTorch's own in
the same run and reports measurement beside prediction.

May import: every lower layer: cost models, plots/ (a lab may save a figure), runtime/ and
parallel/. Never course/ or cli/: the course calls labs, not the other way round.
"""
