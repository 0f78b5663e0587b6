"""Launcher overhead: a 4-rank hello lab via run_lab vs `python -m torch.distributed.run`.

    labkit bench launcher [--nproc 4] [--repeat 3]

Prints the wall time from the run_lab call to its result, the wall time of torchrun started
directly on the same lab in the same run (alternating, median of --repeat), and their ratio.
Targets on a 2-core laptop: run_lab <= 5 s for 4 ranks, ratio <= 1.1. Figures are noisy when
other work shares the cores; the ratio is the figure to read.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAB = "labkit.labs.hello"


def _direct(nproc: int) -> float:
    with tempfile.TemporaryDirectory(prefix="labkit-bench-") as logs:   # torchrun's log dir
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--log-dir", logs, "-m", LAB]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t = time.monotonic()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return time.monotonic() - t


def _via_run_lab(nproc: int) -> float:
    from labkit.runtime.launch import run_lab
    t = time.monotonic()
    result = run_lab(LAB, nproc=nproc, timeout=120, quiet=True)
    elapsed = time.monotonic() - t
    assert all(r["all_reduce"] == r["expected"] for r in result.results), result.results
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit bench launcher", description=__doc__)
    parser.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (default 3)")
    args = parser.parse_args(argv or [])
    _direct(args.nproc)          # warm the page cache so neither side pays for it
    lab, direct = [], []
    for _ in range(args.repeat):
        lab.append(_via_run_lab(args.nproc))
        direct.append(_direct(args.nproc))
    m_lab, m_direct = statistics.median(lab), statistics.median(direct)
    print(f"hello lab, {args.nproc} ranks, {os.cpu_count()} cores, median of {args.repeat}:")
    print(f"  run_lab call -> result   {m_lab:6.2f} s   (runs: {', '.join(f'{x:.2f}' for x in lab)})")
    print(f"  torchrun directly        {m_direct:6.2f} s   (runs: {', '.join(f'{x:.2f}' for x in direct)})")
    print(f"  ratio run_lab / torchrun {m_lab / m_direct:6.3f}   (target <= 1.1)")
    print(f"  run_lab target <= 5 s:   {'met' if m_lab <= 5 else 'not met'}")
    return 0
