"""Tensor-parallel lab: Megatron's layers by hand, DTensor on a Llama, sequence parallelism.

    labkit run tp -n 2                                   # --part block: hand-built vs 1 device
    labkit run tp -n 4 -- --part block --sequence-parallel
    labkit run tp -n 2 -- --part dtensor                 # parallelize_module on a Llama
    labkit run tp -n 2 -- --part sp                      # activations with and without SP
    labkit run tp -n 2 -- --part pitfall                 # dist.all_gather's wrong gradients
    labkit bench tp                                      # step time and bytes at tp 1, 2, 4

Parts: block.py, check.py, dtensor.py, exercise.py, lab.py, sp.py.
"""
from labkit.labs.tp.lab import main, parse_args

__all__ = ['main', 'parse_args']
