"""Hello, distributed world: every rank says who it is, then all ranks all-reduce one number.

    python -m labkit.labs.hello                                   # one process (world size 1)
    torchrun --nproc-per-node 4 -m labkit.labs.hello              # 4 ranks on this machine
    labkit run hello -n 4                                         # the same, via labkit
    labkit run hello -n 4 --nnodes 2 --node-rank R --rdzv-endpoint HOST:29400   # on 2 nodes

Each rank contributes rank + 1, so the sum is N(N+1)/2 on every rank: if the numbers agree, the
ranks found each other and the backend moves data. Reports: rank, world_size, backend, device,
host, all_reduce, expected.
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.runtime import dist, system


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: NCCL when every local rank has a GPU, else gloo")
    args = parser.parse_args(argv)

    ctx = dist.setup(args.backend)
    value = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    tdist.all_reduce(value)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    print(f"rank {ctx.rank} of {ctx.world_size} on {socket.gethostname()}: backend "
          f"{ctx.backend}, device {ctx.device}, all_reduce(rank + 1) = {value.item():g} "
          f"(expected {expected:g})", flush=True)
    dist.report(rank=ctx.rank, world_size=ctx.world_size, backend=ctx.backend,
                device=str(ctx.device), host=socket.gethostname(),
                all_reduce=value.item(), expected=expected,
                # what torchrun (this rank's parent) listens on: `labkit doctor` shows it
                launcher_listens=system.listening_sockets(os.getppid()))
    dist.shutdown()


if __name__ == "__main__":
    main()
