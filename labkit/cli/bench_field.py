"""The planner against measured runs: how its predictions rank and size what was measured.

    labkit bench field                        # the sweep, BLOOM's search, the published runs
    labkit bench field -- --mfu 0.4           # with another matmul efficiency

The Ultra-Scale Playbook's sweep (labkit.field): Spearman of predicted vs measured tokens/s per
GPU within each (model, nodes) group, fits vs ran/crashed, the median predicted / measured
(issue 31's reach: median Spearman >= 0.7 with >= 80 % of groups >= 0.5, fits >= 85 %, median
ratio 0.8-1.25 with >= 50 % within 25 %). Then BigScience's layout search (labkit.field_bloom,
seconds per iteration) and the published runs (predicted / reported TFLOP/s per GPU).
"""
from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit bench field", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mfu", type=float, default=None,
                        help="the planner's matmul efficiency (default: the planner's)")
    args = parser.parse_args(argv or [])
    if args.mfu is not None and not 0 < args.mfu <= 1:
        parser.error(f"--mfu={args.mfu:g} must be in (0, 1]")
    from labkit import field, field_bloom

    kw = {} if args.mfu is None else {"mfu": args.mfu}
    start = time.perf_counter()
    rows = field.price_sweep(**kw)
    metrics = field.sweep_metrics(rows)
    print(metrics.text())
    print(f"priced in {time.perf_counter() - start:.2f} s")
    print(field_bloom.bloom_metrics(field_bloom.price_bloom(**kw)).text())
    print(f"Megatron-DeepSpeed host time per layer and micro-batch, fitted: "
          f"{field_bloom.fit_host() * 1e3:.1f} ms")
    for name, (run, e, ratio) in field.price_published(**kw).items():
        print(f"  {name:<22} {run.layout}: predicted / reported {ratio:.2f}, "
              f"{e.memory / 1e9:.1f} GB")
    return 0
