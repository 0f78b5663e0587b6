"""ZeRO lab: DDP, ZeRO-1/2/3 by hand and torch's ZeroRedundancyOptimizer, measured side by side.

Parts: check.py, exercise.py, lab.py.
"""
from labkit.labs.zero.lab import main, parse_args

__all__ = ['main', 'parse_args']
