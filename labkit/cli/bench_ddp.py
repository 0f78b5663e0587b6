"""DDP throughput: the bucketed reference vs torch's DDP (same model, same run), and overlap's gain.

    labkit bench ddp                         # 2 ranks (one per GPU on a GPU node), 20 steps
    labkit bench ddp -- --nproc 4 --steps 40 --bucket-mb 0.5

Runs `labkit.labs.ddp --part compare`: NaiveDDP, OverlappedDDP, BucketedDDP and torch's DDP train
copies of one GPT-2, interleaved step by step (so noise hits each alike), beside a compute-only
step. Prints median step times, BucketedDDP / torch DDP throughput (goal: >= 0.9) and overlap's
gain (naive / bucketed) with the communication each leaves exposed: read the ratios. Every
other flag goes to the lab.
"""
from __future__ import annotations

import os

GOAL = 0.9          # bucketed / torch throughput


def summary(r: dict) -> dict:
    """The bench's figures from the lab's report (rank 0's): ratios of throughput and step time."""
    t = r["step_s"]
    return dict(bucketed_vs_torch=r["samples_per_s"]["bucketed"] / r["samples_per_s"]["torch"],
                gain_bucketed=t["naive"] / t["bucketed"],
                gain_overlapped=t["naive"] / t["overlapped"],
                exposed={k: t[k] - t["local"] for k in r["impls"] if k != "local"})


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench ddp", __doc__, steps=20, least=5,
                              why="2 warm-up, 1 counted, 1 timeline, then the timed ones")
    args, lab_args = parse(parser, argv)
    result = run_bench_lab(parser.prog, "labkit.labs.ddp", args,
                           ["--part", "compare", "--steps", str(args.steps), *lab_args])
    if result is None:
        return 1
    r = result.results[0]
    s = summary(r)
    timed = len(r["step_times"]["torch"])
    print(f"GPT-2 from config, {r['num_params']:,} parameters; {r['world_size']} ranks x "
          f"{r['batch']} x {r['seq']} tokens ({r['backend']}, {r['device']}); buckets "
          f"{r['bucket_mb']:g} MiB; median of {timed} interleaved steps; {os.cpu_count()} "
          f"cores, load {os.getloadavg()[0]:.1f}")
    print(f"  {'implementation':<22}{'step ms':>9}{'samples/s':>11}{'exposed ms':>12}")
    for k in r["impls"]:
        exposed = f"{1e3 * s['exposed'][k]:>12.1f}" if k in s["exposed"] else f"{'':>12}"
        label = "local (compute only)" if k == "local" else k
        print(f"  {label:<22}{1e3 * r['step_s'][k]:>9.1f}{r['samples_per_s'][k]:>11.1f}{exposed}")
    met = "met" if s["bucketed_vs_torch"] >= GOAL else "not met"
    print(f"  {'throughput, bucketed / torch DDP':<36}{s['bucketed_vs_torch']:6.3f}   "
          f"(goal >= {GOAL}: {met})")
    print(f"  {'overlap gain, naive / bucketed':<36}{s['gain_bucketed']:6.3f}x (step time)")
    print(f"  {'overlap gain, naive / overlapped':<36}{s['gain_overlapped']:6.3f}x (step time)")
    return 0
