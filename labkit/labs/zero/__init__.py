"""ZeRO lab: DDP, ZeRO-1/2/3 by hand and torch's ZeroRedundancyOptimizer, measured side by side.

    torchrun --nproc-per-node 4 -m labkit.labs.zero               # 4 ranks: gloo on CPU
    labkit run zero -n 4 -- --hidden 66 --heads 6                # shards that need padding
    run_lab("labkit.labs.zero", nproc=4)                          # from a notebook

The stages themselves are built in labkit.labs.common.zero_stages (the FSDP lab compares with
them). Parts: check.py, exercise.py, lab.py.
"""
from labkit.labs.zero.lab import main, parse_args

__all__ = ['main', 'parse_args']
