"""DDP throughput: the bucketed reference vs torch's DDP (same model, same run), and overlap's gain.

    labkit bench ddp                         # 2 ranks (one per GPU on a GPU node), 20 steps
    labkit bench ddp -- --nproc 4 --steps 40 --bucket-mb 0.5

Runs `labkit.labs.ddp --part compare` (its docstring says what is measured and how): NaiveDDP,
OverlappedDDP, BucketedDDP and torch.nn.parallel.DistributedDataParallel train copies of one
transformers GPT-2 on the same data, interleaved step by step, with a compute-only step
("local") beside them. Prints each one's median step time and samples per second (global batch
/ step time), then:
- throughput of BucketedDDP / torch DDP (issue 14's goal: >= 0.9);
- the overlap gain: naive's step time / bucketed's (and / overlapped's), with the
  communication each leaves exposed (step time - the compute-only step).
Figures are noisy when other work shares the cores: the steps are interleaved so that noise
hits every implementation alike, and the ratios are the figures to read. Every other flag goes
to the lab.
"""
from __future__ import annotations

import argparse
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
    parser = argparse.ArgumentParser(prog="labkit bench ddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (default: one per GPU, else 2)")
    parser.add_argument("--steps", type=int, default=20,
                        help="steps in all, the first 4 not timed (default 20)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds before the ranks are stopped (default 600)")
    args, lab_args = parser.parse_known_args(argv or [])
    if args.steps < 5:
        parser.error(f"argument --steps: {args.steps} is too few; allowed: >= 5 (2 warm-up, "
                     "1 counted, 1 timeline, then the timed ones)")

    from labkit.runtime import system
    from labkit.runtime.launch import LabError, run_lab

    gpus = system.cuda_device_count()
    nproc = args.nproc or (gpus if gpus >= 2 else 2)
    try:
        result = run_lab("labkit.labs.ddp", nproc=nproc, timeout=args.timeout, quiet=True,
                         args=["--part", "compare", "--steps", str(args.steps), *lab_args])
    except LabError as exc:
        print(f"labkit bench ddp: {exc}")
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
