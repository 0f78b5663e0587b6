"""Fixture lab: rank --rank dies without a Python exception while its peers are in collectives.

    torchrun --nproc-per-node 3 tests/labs/die_on_rank.py --rank 1 --how exit|kill|segv
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as tdist

from labkit.runtime import dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--how", choices=["exit", "kill", "segv"], default="exit")
args = parser.parse_args()

ctx = dist.setup()
x = torch.ones(1024)
tdist.all_reduce(x)
if ctx.rank == args.rank:
    print("going", flush=True)
    time.sleep(0.3)
    if args.how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL if args.how == "kill" else signal.SIGSEGV)
for _ in range(600):            # the peers keep all-reducing until the dead rank is noticed
    tdist.all_reduce(x)
    time.sleep(0.05)
dist.shutdown()
