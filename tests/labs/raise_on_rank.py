"""Fixture lab: rank --rank raises ValueError after an all-reduce; the others wait in a barrier.

    torchrun --nproc-per-node 2 tests/labs/raise_on_rank.py --rank 1
"""
import argparse

import torch
import torch.distributed as tdist

from labkit.runtime import dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, default=1)
args = parser.parse_args()

ctx = dist.setup()
t = torch.ones(1)
tdist.all_reduce(t)
print("ready", flush=True)
if ctx.rank == args.rank:
    raise ValueError(f"boom on rank {ctx.rank}")
tdist.barrier()
dist.shutdown()
