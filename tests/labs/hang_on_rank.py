"""Fixture lab: rank --rank sleeps (never joins); the others wait in an all-reduce.

    torchrun --nproc-per-node 2 tests/labs/hang_on_rank.py --rank 1 [--ignore-sigterm]
"""
import argparse
import signal
import time

import torch
import torch.distributed as tdist

from labkit.runtime import dist

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--ignore-sigterm", action="store_true",
                    help="the stuck rank ignores SIGTERM (only SIGKILL ends it)")
args = parser.parse_args()


def stuck_forever():
    while True:
        time.sleep(1)


ctx = dist.setup()
tdist.barrier()
print("ready", flush=True)
if ctx.rank == args.rank:
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stuck_forever()
tdist.all_reduce(torch.ones(1))
dist.shutdown()
