"""Ranks that stay (%ranks): what a world costs to start, what a cell costs on it, and what the
same cell costs as a %%torchrun cell (fresh ranks each time), with ratios.

    labkit bench ranks [--nproc 4] [--repeat 5] [--hang]

Median of --repeat: World.start() from the warm pool (a started pool; the first start also pays
the pool's `import torch`) and via torchrun; a cell that does nothing and a cell with one
all_reduce of 4 floats, with and without the collective counter; the same all_reduce as a
%%torchrun cell (run_lab on fresh pool ranks). --hang also times a hung cell: its timeout, then
the stack dumps and the world started again. Other work on the cores adds noise: read the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

CELL = "x = torch.ones(4) * (rank + 1)\ndist.all_reduce(x)\nx.sum().item()"


def _median(xs: list[float], unit: str = "s") -> str:
    scale = 1e3 if unit == "ms" else 1.0
    runs = ", ".join(f"{x * scale:.1f}" if unit == "ms" else f"{x:.2f}" for x in xs)
    return f"{statistics.median(xs) * scale:8.2f} {unit}   (runs: {runs})"


def _timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def main(argv: list[str] | None = None) -> int:
    from labkit.runtime import pool
    from labkit.runtime.launch import run_lab
    from labkit.runtime.world import RanksError, World

    parser = argparse.ArgumentParser(prog="labkit bench ranks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each (default 5)")
    parser.add_argument("--hang", action="store_true", help="also time a hung cell (slow)")
    args = parser.parse_args(argv or [])
    n, quiet = args.nproc, (lambda *a: None)
    launchers = ["pool", "torchrun"] if pool.supported() else ["torchrun"]
    print(f"%ranks, {n} ranks, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"median of {args.repeat}:")
    starts: dict[str, list[float]] = {}
    for launcher in launchers:
        times = []
        for _ in range(args.repeat if launcher == "pool" else max(1, args.repeat // 2)):
            w = World(n, launcher=launcher)
            times.append(_timed(lambda: w.start(show=quiet)))
            w.stop()
        starts[launcher] = times
        print(f"  start, {launcher:<9}              {_median(times)}")
    w = World(n, timeout=120).start(show=quiet)
    try:
        w.run(CELL, show=quiet)                        # the first cell's imports
        empty = [_timed(lambda: w.run("None", show=quiet)) for _ in range(args.repeat)]
        counted = [_timed(lambda: w.run(CELL, show=quiet)) for _ in range(args.repeat)]
        bare = [_timed(lambda: w.run(CELL, count=False, show=quiet))
                for _ in range(args.repeat)]
        print(f"  cell, nothing                  {_median(empty, 'ms')}")
        print(f"  cell, all_reduce               {_median(counted, 'ms')}")
        print(f"  cell, all_reduce, not counted  {_median(bare, 'ms')}")
        with tempfile.TemporaryDirectory(prefix="labkit-bench-") as tmp:
            path = os.path.join(tmp, "cell.py")
            with open(path, "w") as f:
                f.write("import torch, torch.distributed as dist\n"
                        "from labkit.runtime import dist as ldist\nctx = ldist.setup()\n"
                        "rank = ctx.rank\n" + CELL.rsplit("\n", 1)[0] + "\n")
            fresh = [_timed(lambda: run_lab(path, nproc=n, timeout=300, quiet=True))
                     for _ in range(args.repeat)]
        print(f"  %%torchrun cell (fresh ranks)  {_median(fresh, 'ms')}")
        ratio = statistics.median(fresh) / statistics.median(counted)
        print(f"  ratio fresh ranks / %%ranks    {ratio:8.1f}")
        if args.hang:
            t = time.monotonic()
            try:
                w.run("if rank == 0:\n    dist.all_reduce(x)", timeout=5, show=quiet)
            except RanksError:
                pass
            print(f"  hung cell, timeout 5 s         {time.monotonic() - t:8.2f} s   "
                  "(timeout + stack dumps + the world started again)")
    finally:
        w.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
