"""Pipeline-parallel lab: GPipe and 1F1B by hand, torch.distributed.pipelining, and PP x DP,
each measured beside labkit.pipeline.simulate.

    labkit run pp -n 4                                   # --part byhand: GPipe, 1F1B by hand
    labkit run pp -n 4 -- --part torch                   # torch's schedules, measured
    labkit run pp -n 4 -- --part torch --schedules zbv,dualpipev   # ZB-V, DualPipeV (or all)
    labkit run pp -n 4 -- --part custom --schedule FILE.csv        # your schedule, torch's CSV
    labkit run pp -n 4 -- --part ppdp                    # pp 2 x dp 2: DDP, FSDP2 on the dp axis
    labkit bench pp                                      # step time, idle share per schedule

Parts: byhand.py, check.py, custom.py, exercise.py, lab.py, ppdp.py, torch_pp.py.
"""
from labkit.labs.pp.lab import main, parse_args

__all__ = ['main', 'parse_args']
