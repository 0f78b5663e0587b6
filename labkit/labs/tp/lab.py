"""Tensor-parallel lab: Megatron's layers by hand, DTensor on a Llama, sequence parallelism.

    labkit run tp -n 2                                   # --part block: hand-built vs 1 device
    labkit run tp -n 4 -- --part block --sequence-parallel
    labkit run tp -n 2 -- --part dtensor                 # parallelize_module on a Llama
    labkit run tp -n 2 -- --part sp                      # activations with and without SP
    labkit run tp -n 2 -- --part pitfall                 # dist.all_gather's wrong gradients
    labkit bench tp                                      # step time and bytes at tp 1, 2, 4

From a notebook: `run_lab("labkit.labs.tp", nproc=2, args=["--part", "dtensor"])`. Sources:
Shoeybi et al. 2019, §3; Korthikanti et al. 2022 (SP); what each part measures: docs/labs.md.
"""
from __future__ import annotations

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.tp import block as block, dtensor as dtensor, sp as sp
from labkit.labs.common.flags import between, check_heads, positive_int, run_and_report

PARTS = ("block", "dtensor", "sp", "pitfall")
RUN = {"block": block.run_block, "dtensor": dtensor.run_dtensor, "sp": sp.run_sp,
       "pitfall": block.run_pitfall}
SIZES = (("--layers", 2, "layers"), ("--hidden", 64, "hidden size"),
         ("--heads", 8, "attention heads"), ("--vocab", 256, "vocabulary"),
         ("--seq", 32, "tokens per sequence"), ("--batch", 2, "sequences (every rank: all)"))
PRINT = {"block": block.print_block, "dtensor": dtensor.print_dtensor, "sp": sp.print_sp,
         "pitfall": block.print_pitfall}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="block", help="what to run (default block)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="--part block: sequence parallelism (all-gather / reduce-scatter)")
    p.add_argument("--plan", action="append", choices=dtensor.PLANS,
                   help="--part dtensor: a plan to run (repeatable; default all)")
    for flag, default, what in SIZES:
        p.add_argument(flag, type=positive_int, default=default, help=f"{what} (default {default})")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="Llama key/value heads (default half the heads, or all when odd)")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="--part dtensor: training steps (the first counted, the rest "
                        "timed); --part block: timed steps after the counted one (default 3)")
    p.add_argument("--lr", type=between(1e-9, 1, "a learning rate"), default=1e-3,
                   help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    args = p.parse_args(argv)
    args.plan = list(dict.fromkeys(args.plan)) if args.plan else list(dtensor.PLANS)
    check_heads(p, args)
    return args, p


def check_degree(p: argparse.ArgumentParser, args, tp: int) -> None:
    """Refuse sizes the tp ranks cannot split evenly: whole heads (and KV heads), hidden and
    MLP features, the vocabulary, and the sequence (sequence parallelism)."""
    for flag, value in (("--heads", args.heads), ("--kv-heads", args.kv_heads),
                        ("--hidden", args.hidden), ("--vocab", args.vocab), ("--seq", args.seq)):
        if value % tp:
            p.error(f"argument {flag}: {value} does not divide over the {tp} tensor-parallel "
                    f"ranks; allowed: a multiple of {tp}")


@record
def main(argv: list[str] | None = None) -> None:
    args, p = parse_args(argv)
    run_and_report(RUN[args.part], PRINT[args.part], args,
                   check=lambda world: check_degree(p, args, world))


if __name__ == "__main__":
    main()
