"""3D parallelism lab: a named DeviceMesh, TP + FSDP2, PP + DP, pp x dp x tp on 8 ranks, CP.

    labkit run threed -n 4 -- --part mesh       # dp2 x tp2 (or -n 8: pp2 x dp2 x tp2)
    labkit run threed -n 4 -- --part 2d         # TP + FSDP2 on a transformers Llama
    labkit run threed -n 4 -- --part ppdp       # pipeline x FSDP2 (pp2 x dp2)
    labkit run threed -n 8 -- --part 3d         # pp2 x dp2 x tp2
    labkit run threed -n 2 -- --part cp         # ring attention (or -n 4)
    labkit bench 3d                             # step time per layout

Parts: check.py, cp.py, exercise.py, lab.py, mesh.py, pp.py, shared.py, two_d.py.
"""
from labkit.labs.threed.lab import main, parse_args, check_world

__all__ = ['main', 'parse_args', 'check_world']
