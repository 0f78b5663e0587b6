"""ZeRO's price: each stage's step time against DDP's, beside the memory per rank it saves.

    labkit bench zero                        # 2 ranks (one per GPU on a GPU node), 12 steps
    labkit bench zero -- --nproc 4 --steps 20 --hidden 256 --layers 4

Runs `labkit.labs.zero`: torch DDP, labkit's ZeRO-1, -2, -3 and torch's ZeroRedundancyOptimizer
train copies of one Llama, interleaved step by step (so noise hits each alike). Prints per
implementation the median step time and its ratio to DDP's, rank 0's model-state bytes and their
share of DDP's, and the ring bytes per rank as a multiple of DDP's (1, 1, 1.5 for stages 1, 2,
3; torch's ZeRO-1: 1.5). Every other flag goes to the lab.
"""
from __future__ import annotations

import os


def summary(r: dict) -> dict:
    """The bench's figures from the lab's report (rank 0's), each implementation against DDP:
    step time, model-state bytes held, ring bytes sent per rank for what was issued."""
    stages = r["stages"]

    def held(k):
        return sum(stages[k]["measured"].values())

    def ring(k):                  # one rank sends nothing: no ratio
        return stages[k]["wire"]["issued_ring"] or float("nan")

    return {k: dict(step=r["step_vs_ddp"][k], memory=held(k) / held("ddp"),
                    wire=ring(k) / ring("ddp")) for k in r["impls"]}


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench zero", __doc__, steps=12, least=4,
                              why="2 warm-up, 1 counted, then the timed ones")
    args, lab_args = parse(parser, argv)
    result = run_bench_lab(parser.prog, "labkit.labs.zero", args,
                           ["--steps", str(args.steps), *lab_args])
    if result is None:
        return 1
    r = result.results[0]
    if "ddp" not in r["impls"]:
        print("labkit bench zero: the ratios are to DDP's; do not leave out --impl ddp")
        return 1
    s = summary(r)
    print(f"Llama from config, {r['num_params']:,} parameters, fp32 AdamW; {r['world_size']} "
          f"ranks x {r['batch']} x {r['seq']} tokens ({r['backend']}, {r['device']}); median "
          f"of {r['steps'] - 3} interleaved steps; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'implementation':<14}{'step ms':>9}{'x DDP':>7}{'states MB':>11}{'x DDP':>7}"
          f"{'ring bytes x DDP':>18}")
    for k in r["impls"]:
        mb = sum(r["stages"][k]["measured"].values()) / 1e6
        print(f"  {k:<14}{1e3 * r['step_s'][k]:>9.1f}{s[k]['step']:>7.2f}{mb:>11.2f}"
              f"{s[k]['memory']:>7.3f}{s[k]['wire']:>18.2f}")
    return 0
