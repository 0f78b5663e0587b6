"""Fixture lab: a rank dies in the middle of labkit.parallel.checkpoint.save.

    torchrun --nproc-per-node 2 tests/labs/ckpt_crash_in_save.py --ckpt-dir D --when data|metadata

Saves a small FSDP2 model + AdamW as step 1 (complete), then dies while saving step 2:
- data: rank 1 is killed (SIGKILL) right after it has written its shard file, before rank 0
  gathers the write results (no .metadata yet);
- metadata: rank 0 is killed right after DCP has written .metadata (every rank's data and the
  index are on disk), before labkit's own last step.
"""
import argparse
import os
import signal

import torch
import torch.distributed.checkpoint as dcp

from labkit.parallel import checkpoint
from labkit.parallel.fsdp import shard_model
from labkit.runtime import dist

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", required=True)
parser.add_argument("--when", choices=["data", "metadata"], required=True)
args = parser.parse_args()

ctx = dist.setup()
model = shard_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                    per_block=False)
opt = torch.optim.AdamW(model.parameters())


def train_step():
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def die(original):
    def wrapped(self, *a, **k):
        out = original(self, *a, **k)
        if hasattr(out, "wait"):
            out.wait()
        print(f"dying after {original.__name__}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return wrapped


train_step()
checkpoint.save(model, opt, 1, args.ckpt_dir)
train_step()
if args.when == "data" and ctx.rank == 1:
    dcp.FileSystemWriter.write_data = die(dcp.FileSystemWriter.write_data)
if args.when == "metadata" and ctx.rank == 0:
    dcp.FileSystemWriter.finish = die(dcp.FileSystemWriter.finish)
checkpoint.save(model, opt, 2, args.ckpt_dir)
dist.shutdown()
