"""Fixture lab: print, sleep, print again, report; shows whether output streams live.

    torchrun --nproc-per-node 2 tests/labs/slow_print.py --sleep 2
"""
import argparse
import time

from labkit.runtime import dist

parser = argparse.ArgumentParser()
parser.add_argument("--sleep", type=float, default=2.0)
args = parser.parse_args()

ctx = dist.setup()
print(f"tick 0 from {ctx.rank}", flush=True)
time.sleep(args.sleep)
dist.progress(1, 2, loss=0.5)
print(f"tick 1 from {ctx.rank}", flush=True)
dist.report(rank=ctx.rank, slept=args.sleep)
dist.report(done=True)
for i in range(200):        # a burst just before exit: none of it may be lost
    print(f"burst {i} from {ctx.rank}")
dist.shutdown()
