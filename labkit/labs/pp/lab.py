"""Pipeline-parallel lab: GPipe and 1F1B by hand, torch.distributed.pipelining, and PP x DP,
each measured beside labkit.pipeline.simulate.

    labkit run pp -n 4                                   # --part byhand: GPipe, 1F1B by hand
    labkit run pp -n 4 -- --part torch                   # torch's schedules, measured
    labkit run pp -n 4 -- --part ppdp                    # pp 2 x dp 2: DDP, FSDP2 on the dp axis
    labkit bench pp                                      # step time, idle share per schedule

From a notebook: `run_lab("labkit.labs.pp", nproc=4, args=["--part", "torch"])`;
`labkit.plots.pp` draws the timelines. Sources: Huang et al. 2019 (GPipe), Narayanan et al.
2021, §2.2 (1F1B); the model, the sleep and what each part measures: docs/labs.md, ## pp.
"""
from __future__ import annotations

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.pp import byhand as byhand
from labkit.labs.common.flags import between, check_heads, positive_int, run_and_report

PARTS = ("byhand", "torch", "ppdp")
SIZES = (("--layers", 8, "blocks"), ("--hidden", 64, "hidden size"),
         ("--heads", 4, "attention heads"), ("--vocab", 256, "vocabulary"),
         ("--seq", 32, "tokens per sequence"))


def _torch():
    from labkit.labs.pp import torch_pp
    return torch_pp


def _ppdp():
    from labkit.labs.pp import ppdp
    return ppdp


RUN = {"byhand": lambda a, c: byhand.run_byhand(a, c),
       "torch": lambda a, c: _torch().run_torch(a, c),
       "ppdp": lambda a, c: _ppdp().run_ppdp(a, c)}
PRINT = {"byhand": lambda r: byhand.print_byhand(r),
         "torch": lambda r: _torch().print_torch(r),
         "ppdp": lambda r: _ppdp().print_ppdp(r)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="byhand", help="what to run (default byhand)")
    for flag, default, what in SIZES:
        p.add_argument(flag, type=positive_int, default=default, help=f"{what} (default {default})")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="Llama key/value heads (default half the heads, or all when odd)")
    p.add_argument("--microbatches", type=positive_int, default=8,
                   help="micro-batches per step, m (default 8)")
    p.add_argument("--micro-batch", type=positive_int, default=1,
                   help="sequences per micro-batch (default 1)")
    p.add_argument("--chunks", type=positive_int, default=2,
                   help="--part torch: model chunks per rank of interleaved 1F1B, v (default 2)")
    p.add_argument("--sleep", type=between(0, 5, "seconds"), default=0.03,
                   help="seconds each stage sleeps per forward, 2x per backward (default 0.03)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="measured steps per schedule; the shortest (least disturbed) is "
                        "reported (default 5)")
    p.add_argument("--steps", type=positive_int, default=2,
                   help="--part ppdp: SGD steps per variant (default 2)")
    p.add_argument("--lr", type=between(1e-9, 10, "a learning rate"), default=0.5,
                   help="--part ppdp: SGD learning rate (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    args = p.parse_args(argv)
    check_heads(p, args)
    return args, p


def check_sizes(p: argparse.ArgumentParser, args, world: int) -> None:
    """Refuse sizes the ranks cannot split: equal stages (layers, and interleaved chunks),
    interleaved m a multiple of the stages (as labkit.pipeline and Megatron-LM), ppdp 4 ranks."""
    pp = 2 if args.part == "ppdp" else world
    if args.part == "ppdp" and world != 4:
        p.error(f"--part ppdp runs pp 2 x dp 2: {world} ranks given; allowed: 4 (-n 4)")
    if world < 2:
        p.error(f"a pipeline needs at least 2 ranks, {world} given; allowed: -n 2 or more")
    virtual = pp * (args.chunks if args.part == "torch" else 1)
    if args.layers % virtual:
        p.error(f"argument --layers: {args.layers} does not split into {virtual} equal stages "
                f"({pp} ranks" + (f" x --chunks {args.chunks})" if virtual != pp else ")")
                + f"; allowed: a multiple of {virtual}")
    if args.part == "torch" and args.microbatches % world:
        p.error(f"argument --microbatches: {args.microbatches} is not a multiple of the {world} "
                f"stages (interleaved 1F1B needs it); allowed: a multiple of {world}")
    if args.part != "ppdp" and args.microbatches < world:
        p.error(f"argument --microbatches: {args.microbatches} is fewer than the {world} stages "
                f"(torch's Schedule1F1B refuses it); allowed: {world} or more")


@record
def main(argv: list[str] | None = None) -> None:
    args, p = parse_args(argv)
    run_and_report(RUN[args.part], PRINT[args.part], args,
                   check=lambda world: check_sizes(p, args, world))


if __name__ == "__main__":
    main()
