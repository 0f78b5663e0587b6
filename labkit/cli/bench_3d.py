"""3D parallelism priced: step time of one Llama under each layout (dp x tp, pp x dp, pp x dp x tp).

    labkit bench 3d                             # the three layouts, 4 AdamW steps each
    labkit bench 3d --steps 6 -- --layers 8 --hidden 128

Runs `labkit.labs.threed --part 2d` (4 ranks: tp2 x dp2), `--part ppdp` (4 ranks: pp2 x dp2) and
`--part 3d` (8 ranks: pp2 x dp2 x tp2) on one model and global batch; prints per layout the
median step time, the loss difference from one process, and rank 0's model-state bytes beside
labkit.memory's. On CPU the ranks share the cores: the times show what communication and
contention cost, not a speed-up. Every other flag goes to the lab.
"""
from __future__ import annotations

import os

LAYOUTS = (("2d", 4), ("ppdp", 4), ("3d", 8))


def row(r: dict) -> dict:
    """A layout's figures from rank 0's report."""
    st = r["states"]
    ratio = st["ratio"]["params"]
    return dict(degrees=r["degrees"].split(" = ")[0], step_s=r["step_s"],
                loss_diff=r["loss_max_diff"], state_bytes=sum(st["measured"].values()),
                ratio=ratio)


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench 3d", __doc__, steps=4, least=2,
                              why="the first step warms up, the rest are timed")
    args, lab_args = parse(parser, argv)
    if args.nproc is not None:
        parser.error("argument --nproc: not used here; allowed: none (each layout sets its "
                     "ranks: 4, 4 and 8)")
    print(f"median step time per layout; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'layout':<22}{'ranks':>6}{'step ms':>9}{'|loss diff|':>13}{'states B':>11}"
          f"{'ratio':>7}")
    for part, nproc in LAYOUTS:
        args.nproc = nproc
        result = run_bench_lab(parser.prog, "labkit.labs.threed", args,
                               ["--part", part, "--steps", str(args.steps), *lab_args])
        if result is None:
            return 1
        x = row(result.results[0])
        print(f"  {x['degrees']:<22}{nproc:>6}{1e3 * x['step_s']:>9.1f}{x['loss_diff']:>13.1e}"
              f"{x['state_bytes']:>11,}{x['ratio']:>7.3f}")
    return 0
