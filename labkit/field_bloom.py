"""BigScience's search for BLOOM-176B's layout, priced as run: a second measured sweep.

    >>> rows = price_bloom()                  # 65 configurations on 48 nodes of 8 A100s
    >>> fit_host(rows)                        # Megatron-DeepSpeed's host seconds per layer
    >>> bloom_metrics(rows).text()

labkit/data/bigscience_topology_2022.csv (its header gives the source and set-up): seconds per
iteration of models of 176-206B (hidden 12,288-14,336, 70-106 layers) over TP 1-8, PP 1-48,
DP 4-48 and micro-batches 1-8, or OOM. Priced with labkit.kernels' "megatron-deepspeed"
framework, whose one constant, the host time per layer and micro-batch, comes from this data
(`fit_host`): it is the only place the course measures it. Pure Python.
"""
from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

from labkit.field import OMNI_PATH, spearman
from labkit.models import BLOOM_176B

BLOOM_CSV = Path(__file__).resolve().parent / "data" / "bigscience_topology_2022.csv"
HEADS = 64
BLOOM_SETUP = dict(gpu="a100-80gb", gpus_per_node=8, seq_len=2048, implementation="megatron",
                   inter_link=OMNI_PATH, framework="megatron-deepspeed")


@dataclass
class BloomRow:
    date: str
    model: object                   # labkit.models.ModelSpec
    layout: object                  # labkit.planner.Layout
    global_batch: int
    grad_accum: str                 # "param" / "fp32" (labkit.precision.GRAD_ACCUM)
    status: str                     # "ok" / "oom"
    measured_s: float | None        # seconds per iteration
    measured_gb: float | None
    estimate: object = None

    @property
    def ratio(self) -> float | None:
        """Predicted / measured seconds per iteration."""
        if self.estimate is None or not self.measured_s:
            return None
        return self.estimate.step_time / self.measured_s


def bloom_rows(path: Path | str = BLOOM_CSV) -> list[BloomRow]:
    """The configurations (not priced): BLOOM's layer at each row's width and depth."""
    from labkit.planner import Layout

    def number(text):
        return float(text) if text else None

    with open(path, encoding="utf-8") as f:
        reader = csv.DictReader(line for line in f if not line.startswith("#"))
        out = []
        for r in reader:
            h, L = int(r["hidden"]), int(r["layers"])
            spec = BLOOM_176B.with_(name=f"bloom-search-{h}x{L}", hidden_size=h, num_layers=L,
                                    num_heads=HEADS, num_kv_heads=HEADS, ffn_size=4 * h)
            lay = Layout(tp=int(r["tp"]), pp=int(r["pp"]), dp=int(r["dp"]), sharding="zero1",
                         micro_batch=int(r["micro_batch"]), recompute="full")
            if lay.gpus != 8 * int(r["nodes"]):
                raise ValueError(f"{path}: {r['date']} {lay}: {lay.gpus} GPUs on "
                                 f"{r['nodes']} nodes of 8")
            out.append(BloomRow(r["date"], spec, lay, int(r["global_batch"]), r["grad_accum"],
                                r["status"], number(r["sec_per_it"]), number(r["mem_gb"])))
    return out


def price_bloom(rows: list[BloomRow] | None = None, **planner_kwargs) -> list[BloomRow]:
    """Each row `evaluate`d as it ran (BLOOM_SETUP; `planner_kwargs` override)."""
    from labkit.planner import evaluate

    rows = bloom_rows() if rows is None else rows
    for row in rows:
        row.estimate = evaluate(row.model, row.layout, global_batch=row.global_batch,
                                grad_accum=row.grad_accum, **{**BLOOM_SETUP, **planner_kwargs})
    return rows


def fit_host(rows: list[BloomRow] | None = None) -> float:
    """Host seconds per layer and micro-batch that best explain the measured times beyond
    labkit's device time, by least squares (the host time adds: the launches block)."""
    from labkit.kernels import FRAMEWORKS

    host = FRAMEWORKS["megatron-deepspeed"].host_per_layer
    num = den = 0.0
    for r in price_bloom(rows):
        if not r.measured_s:
            continue
        b = r.estimate.breakdown
        # what 1 s of host time per layer and micro-batch adds to this step: the slowest
        # stage's layers x the micro-batches, and the bubble grows with it
        relative = b["bubble"] / (b["compute"] + b["host"] + b["tp"] + b["cp"])
        unit = b["host"] / host * (1 + relative)
        num += unit * (r.measured_s - (r.estimate.step_time - unit * host))
        den += unit * unit
    return num / den


@dataclass
class BloomMetrics:
    runs: int
    spearman: float                 # predicted vs measured seconds per iteration
    median_ratio: float             # predicted / measured
    share_within_10: float
    share_within_25: float
    fits_agreement: float           # predicted fit vs ran / OOM

    def text(self) -> str:
        return (f"BigScience's layout search: {self.runs} runs; Spearman {self.spearman:+.2f}; "
                f"predicted / measured s/iteration: median {self.median_ratio:.2f}, "
                f"{self.share_within_10:.0%} within 10 %, {self.share_within_25:.0%} within "
                f"25 %; fits vs ran/OOM: {self.fits_agreement:.0%} agree")


def bloom_metrics(rows: list[BloomRow]) -> BloomMetrics:
    ran = [r for r in rows if r.ratio is not None]
    ratios = [r.ratio for r in ran]
    fits = [r.estimate.fits == (r.status == "ok") for r in rows if r.estimate is not None]
    return BloomMetrics(
        len(ran), spearman([r.estimate.step_time for r in ran], [r.measured_s for r in ran]),
        statistics.median(ratios), sum(abs(x - 1) <= 0.10 for x in ratios) / len(ratios),
        sum(abs(x - 1) <= 0.25 for x in ratios) / len(ratios), sum(fits) / len(fits))
