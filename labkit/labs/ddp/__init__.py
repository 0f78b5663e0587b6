"""DDP lab: the three reference DDPs beside torch's DistributedDataParallel, measured in one run;
torch DDP's flags; a straggler; DistributedSampler on real ranks.

    python -m labkit.labs.ddp                                        # one process (nothing sent)
    torchrun --nproc-per-node 2 -m labkit.labs.ddp --part compare     # 2 ranks: gloo on CPU
    torchrun --nproc-per-node 4 -m labkit.labs.ddp --part flags --caps 0.25,1,25
    labkit run ddp -n 2 -- --part straggler --sleep 0.05              # via labkit
    labkit run ddp -n 4 -- --part sampler --samples 10
    labkit bench ddp                                                 # throughput, bucketed vs torch

Parts: check.py, exercise.py, lab.py, torch_parts.py.
"""
from labkit.labs.ddp.lab import main, parse_args

__all__ = ['main', 'parse_args']
