"""FSDP2's options priced: step time and memory of each against the default's.

    labkit bench fsdp                        # 2 ranks (one per GPU on a GPU node), 6 steps
    labkit bench fsdp -- --nproc 4 --steps 10 --model gpt2 --layers 4

Runs `labkit.labs.fsdp --part options`: the default (per block, reshard_after_forward=True, fp32)
and each option train copies of one model, interleaved step by step (so noise hits each alike).
Prints per option the median step time and its ratio to the default's, the unsharded-parameter
bytes (at the peak, and held between forward and backward), the collectives' bytes as a multiple
of the default's, and the saved activations. Every other flag goes to the lab.
"""
from __future__ import annotations

import os


def summary(r: dict) -> dict:
    """The bench's figures from the options report (rank 0's), each option against the
    default: step time, peak unsharded bytes, collective bytes, saved activations."""
    res = r["results"]

    def sent(k):
        return sum(c["bytes"] for c in res[k]["collectives"].values())

    d = res["default"]
    return {k: dict(step=s["step_s"] / d["step_s"], peak=s["peak"] / d["peak"],
                    sent=sent(k) / sent("default"),
                    saved=s["saved_activations"] / d["saved_activations"])
            for k, s in res.items()}


def main(argv: list[str] | None = None) -> int:
    from labkit.cli._lab_bench import lab_bench_parser, parse, run_bench_lab

    parser = lab_bench_parser("labkit bench fsdp", __doc__, steps=6, least=3,
                              why="1 warm-up, 1 counted, then the timed ones")
    args, lab_args = parse(parser, argv)
    result = run_bench_lab(parser.prog, "labkit.labs.fsdp", args,
                           ["--part", "options", "--steps", str(args.steps), *lab_args])
    if result is None:
        return 1
    r = result.results[0]
    s = summary(r)
    print(f"transformers {r['model']} from config, {r['num_params']:,} parameters, fp32 AdamW; "
          f"{r['world_size']} ranks x {r['batch']} x {r['seq']} tokens; median of "
          f"{max(1, r['steps'] - 2)} interleaved steps; {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}")
    print(f"  {'option':<12}{'step ms':>9}{'x dflt':>8}{'peak KB':>9}{'x dflt':>8}"
          f"{'held KB':>9}{'S x dflt':>10}{'saved KB':>10}{'x dflt':>8}")
    for k, f in s.items():
        x = r["results"][k]
        print(f"  {k:<12}{1e3 * x['step_s']:>9.1f}{f['step']:>8.2f}{x['peak'] / 1e3:>9.1f}"
              f"{f['peak']:>8.2f}{x['held'] / 1e3:>9.1f}{f['sent']:>10.2f}"
              f"{x['saved_activations'] / 1e3:>10.1f}{f['saved']:>8.2f}")
    for k, why in r["skipped"].items():
        print(f"  {k}: skipped: {why}")
    print(f"  {r['note']}")
    return 0
