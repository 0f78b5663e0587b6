"""3D parallelism lab: a named DeviceMesh, TP + FSDP2, PP + DP, pp x dp x tp on 8 ranks, CP.

    labkit run threed -n 4 -- --part mesh       # dp2 x tp2 (or -n 8: pp2 x dp2 x tp2)
    labkit run threed -n 4 -- --part 2d         # TP + FSDP2 on a transformers Llama
    labkit run threed -n 4 -- --part ppdp       # pipeline x FSDP2 (pp2 x dp2)
    labkit run threed -n 8 -- --part 3d         # pp2 x dp2 x tp2
    labkit run threed -n 2 -- --part cp         # ring attention (or -n 4)
    labkit bench 3d                             # step time per layout

From a notebook: `run_lab("labkit.labs.threed", nproc=4, args=["--part", "2d"])`. Built on
labkit.parallel.mesh and labkit.parallel.context; what each part measures: docs/labs.md.
"""
from __future__ import annotations

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.threed import mesh as meshpart, two_d as two
from labkit.labs.common.flags import between, check_heads, positive_int, run_and_report
from labkit.labs.common.flags import model_flags

PARTS = ("mesh", "2d", "ppdp", "3d", "cp")
RANKS = {"mesh": (4, 8), "2d": (4,), "ppdp": (4,), "3d": (8,), "cp": (2, 4)}


def _part(name: str):
    """(run, print) of a part; the pipeline and ring-attention parts are imported on use."""
    if name == "mesh":
        return meshpart.run_mesh, meshpart.print_mesh
    if name == "2d":
        return two.run_2d, two.print_2d
    if name in ("ppdp", "3d"):
        from labkit.labs.threed import pp as pp
        return pp.run_pp, pp.print_pp
    from labkit.labs.threed import cp as cp
    return cp.run_cp, cp.print_cp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=PARTS, default="mesh", help="what to run (default mesh)")
    model_flags(p, layers=4, hidden=64, heads=8, vocab=256, seq=32, batch=2)
    p.add_argument("--microbatches", type=positive_int, default=2,
                   help="--part ppdp/3d: micro-batches per step and replica (default 2)")
    p.add_argument("--steps", type=positive_int, default=2, help="AdamW steps (default 2)")
    p.add_argument("--lr", type=between(1e-9, 1, "a learning rate"), default=1e-3,
                   help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    args = p.parse_args(argv)
    check_heads(p, args)
    args.micro_batch = args.batch
    return args, p


def check_world(p: argparse.ArgumentParser, args, world: int) -> None:
    """Refuse a world size the part does not lay out, and sizes its degrees cannot split."""
    allowed = RANKS[args.part]
    if world not in allowed:
        p.error(f"--part {args.part} runs on {' or '.join(map(str, allowed))} ranks, not "
                f"{world}; allowed: labkit run threed -n {allowed[0]} -- --part {args.part}")
    for flag, value in (("--heads", args.heads), ("--kv-heads", args.kv_heads),
                        ("--hidden", args.hidden), ("--vocab", args.vocab), ("--seq", args.seq),
                        ("--layers", args.layers)):
        if value % 4:
            p.error(f"argument {flag}: {value} does not split over the lab's degrees; "
                    f"allowed: a multiple of 4")


@record
def main(argv: list[str] | None = None) -> None:
    args, p = parse_args(argv)
    run, show = _part(args.part)
    run_and_report(run, show, args, check=lambda world: check_world(p, args, world))


if __name__ == "__main__":
    main()
