"""Collective bandwidth on this machine: all_reduce, all_gather, reduce_scatter over a size sweep.

    labkit bench collectives                       # 4 ranks (one per GPU on a GPU node)
    labkit bench collectives -- --nproc 8 -e 256M -n 20 --plot /tmp/coll.png

Runs the lab `labkit.labs.collectives` (docs/labs.md gives the table's conventions, which are
nccl-tests') under labkit.runtime.launch.run_lab: prints the algbw/busbw table per op, the alpha-beta fit
of each op (and what it means as the ring model's latency and link bandwidth), and saves the
plot (default: collectives.png in a new private temporary directory). Every other flag goes to the lab.
"""
from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit bench collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: one per GPU, else 4 on CPU)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds before the ranks are stopped (default 600)")
    args, lab_args = parser.parse_known_args(argv or [])

    from labkit.runtime import system
    from labkit.runtime.launch import LabError, run_lab

    nproc = args.nproc or system.default_nproc()
    try:
        result = run_lab("labkit.labs.collectives", nproc=nproc, args=lab_args,
                         timeout=args.timeout)
    except LabError as exc:
        print(f"labkit bench collectives: {exc}")
        return 1
    fits = result.results[0].get("fits", {})
    return 0 if fits or not result.results[0].get("rows") else 1
