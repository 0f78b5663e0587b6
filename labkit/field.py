"""The planner against the field: a measured layout sweep and published runs, priced as run.

    >>> rows = price_sweep()                  # every configuration of the sweep, `evaluate`d
    >>> m = sweep_metrics(rows); m.median_spearman, m.fits_agreement, m.median_ratio
    >>> print(m.text())

The sweep (labkit/data/usp_sweep_1b_8b.csv, its header gives the source): every configuration
of the Hugging Face Ultra-Scale Playbook's benchmark figure for its 1B and 8B models, 1 to 64
nodes of 8 H100s, measured tokens/s per GPU and memory, or crashed/OOM. Each is priced as it was
run (`SWEEP_SETUP`). `published_runs()` / `price_published()`: runs from their papers. Pure Python.
"""
from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from labkit.hardware import Link
from labkit.models import _llama

SWEEP_CSV = Path(__file__).resolve().parent / "data" / "usp_sweep_1b_8b.csv"
# The sweep's models (the CSV header: nanotron's scaling_benchmarks.py model_configs, KV heads
# = heads, vocabulary 131,072; the 1B ties its embeddings).
SWEEP_MODELS = {
    "1B": _llama("usp-1b", 2048, 16, 32, 32, 8192, 131072, 4096).with_(tied_embeddings=True),
    "8B": _llama("usp-8b", 4096, 32, 32, 32, 14336, 131072, 4096),
}
# How every configuration ran (the CSV header): H100 SXM nodes of 8, sequence 4,096, bf16 with
# fp32 gradient accumulation, no recomputation, sequence parallelism with TP, 1F1B.
SWEEP_SETUP = dict(gpu="h100-sxm", gpus_per_node=8, seq_len=4096, precision="bf16-mixed",
                   grad_accum="fp32", schedule="1f1b", framework="nanotron")
# A run more than this many times slower than its (model, nodes) group's best is one of that
# framework's breakdowns (pipeline or cross-node TP), not something a cost model prices: left
# out of the rank correlations and ratios, and counted (`SweepMetrics.left_out`).
BREAKDOWN = 10.0
# Jean Zay (BLOOM's cluster): 4 x 100 Gb/s Omni-Path per node of 8 A100s
OMNI_PATH = Link("Omni-Path, 4 x 100 Gb/s per node of 8 GPUs", 4 * 100e9 / 8 / 8,
                 2 * 4 * 100e9 / 8 / 8, "4 x 100 Gb/s per node", 2e-6, "inter-node")


@dataclass
class SweepRow:
    model: str
    nodes: int
    layout: object                  # labkit.planner.Layout
    grad_acc: int
    status: str                     # "ok" or "oom" (crashed / out of memory)
    measured_tokens: float | None   # tokens/s per GPU, when the figure has them
    measured_mfu: float | None
    measured_gb: float | None
    estimate: object = None         # labkit.planner.Estimate, or None
    problem: str = ""               # why it could not be priced

    @property
    def predicted_tokens(self) -> float | None:
        e = self.estimate
        return None if e is None else e.tokens_per_second / e.layout.gpus


def sweep_rows(path: Path | str = SWEEP_CSV) -> list[SweepRow]:
    """The sweep's configurations (not priced)."""
    from labkit.planner import Layout

    def number(text):
        return float(text) if text not in ("", None) else None

    with open(path, encoding="utf-8") as f:
        reader = csv.DictReader(line for line in f if not line.startswith("#"))
        rows = []
        for r in reader:
            tp, pp, dp = int(r["tp"]), int(r["pp"]), int(r["dp"])
            lay = Layout(tp=tp, pp=pp, dp=dp, sharding="zero1" if r["zero"] == "1" else "ddp",
                         micro_batch=int(r["mbs"]), recompute="none",
                         sequence_parallel=tp > 1)
            rows.append(SweepRow(r["model"], int(r["nodes"]), lay, int(r["grad_acc"]),
                                 r["status"], number(r["tok_s_gpu"]), number(r["mfu"]),
                                 number(r["mem_gb"])))
    return rows


def price_sweep(rows: list[SweepRow] | None = None, **planner_kwargs) -> list[SweepRow]:
    """Each row `evaluate`d as it ran (SWEEP_SETUP, its model, global batch = micro-batch x
    gradient accumulation x dp); `planner_kwargs` override (e.g. mfu=)."""
    from labkit.planner import evaluate

    rows = sweep_rows() if rows is None else rows
    for row in rows:
        lay = row.layout
        try:
            row.estimate = evaluate(SWEEP_MODELS[row.model], lay,
                                    global_batch=lay.micro_batch * row.grad_acc * lay.dp,
                                    **{**SWEEP_SETUP, **planner_kwargs})
        except ValueError as exc:
            row.problem = str(exc)
    return rows


def fit_pp_tp_wait(rows: list[SweepRow] | None = None) -> float:
    """nanotron's wait per layer, micro-batch and TP rank when a pipeline hop crosses nodes
    with TP inside a stage (`labkit.kernels.Framework.pp_tp_wait`), read off the runs the host
    bounds: micro-batch 1, pp > 1, 1 < tp <= a node, more than one node, finished, within
    BREAKDOWN of their group's best. Each run: its seconds per 1F1B slot (step / (m + p - 1))
    per layer of its fullest stage, less nanotron's host time per layer, per TP rank. The median
    over the runs (a framework's own cost, measured: no term of the hardware explains it)."""
    from labkit.kernels import FRAMEWORKS
    from labkit.placement import stage_layers

    rows = sweep_rows() if rows is None else rows
    host = FRAMEWORKS["nanotron"].host_per_layer
    best: dict = {}
    for r in rows:
        if r.measured_tokens and r.status == "ok":
            key = (r.model, r.nodes)
            best[key] = max(best.get(key, 0.0), r.measured_tokens)
    waits = []
    for r in rows:
        lay = r.layout
        if (r.status != "ok" or not r.measured_tokens or lay.micro_batch != 1 or lay.pp == 1
                or not 1 < lay.tp <= SWEEP_SETUP["gpus_per_node"] or r.nodes == 1
                or r.measured_tokens < best[r.model, r.nodes] / BREAKDOWN):
            continue
        spec = SWEEP_MODELS[r.model]
        tokens = lay.micro_batch * r.grad_acc * lay.dp * SWEEP_SETUP["seq_len"]   # per step
        slot = tokens / (lay.gpus * r.measured_tokens) / (r.grad_acc + lay.pp - 1)
        layers = max(stage_layers(spec.num_layers, lay.pp, False))
        waits.append((slot / layers - host) / lay.tp)
    return statistics.median(waits)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


@dataclass
class SweepMetrics:
    groups: dict = field(default_factory=dict)     # (model, nodes) -> (spearman, runs)
    fits_agreement: float = 0.0     # share of priced rows whose fit = ran (ok) / crashed (oom)
    priced: int = 0
    unpriced: int = 0               # rows `evaluate` refused (e.g. TP across nodes)
    left_out: int = 0               # runs > BREAKDOWN x slower than their group's best
    crashed: int = 0                # crashed runs with figures: not a steady state, left out
    ratios: list = field(default_factory=list)     # predicted / measured tokens/s per GPU

    @property
    def median_spearman(self) -> float:
        return statistics.median(r for r, _ in self.groups.values())

    @property
    def share_groups_at_half(self) -> float:
        return sum(r >= 0.5 for r, _ in self.groups.values()) / len(self.groups)

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def share_within_25(self) -> float:
        return sum(0.75 <= x <= 1.25 for x in self.ratios) / len(self.ratios)

    def text(self) -> str:
        lines = [f"{self.priced:,} configurations priced ({self.unpriced:,} refused by the "
                 f"planner; {self.left_out:,} runs > {BREAKDOWN:g}x slower than their group's "
                 f"best and {self.crashed} crashed runs' partial figures left out)",
                 f"rank correlation (Spearman) of predicted vs measured tokens/s per (model, "
                 f"nodes) group: median {self.median_spearman:.2f}, "
                 f"{self.share_groups_at_half:.0%} of {len(self.groups)} groups >= 0.5",
                 f"fits vs ran/crashed: {self.fits_agreement:.1%} agree",
                 f"predicted / measured tokens/s: median {self.median_ratio:.2f}, "
                 f"{self.share_within_25:.0%} within 25 %"]
        for (model, nodes), (rho, n) in sorted(self.groups.items(),
                                               key=lambda kv: (kv[0][0], kv[0][1])):
            lines.append(f"  {model} on {nodes:>2} nodes: Spearman {rho:+.2f} over {n} runs")
        return "\n".join(lines)


def sweep_metrics(rows: list[SweepRow]) -> SweepMetrics:
    """How the priced `rows` agree with what was measured: fits against ran / crashed over
    every priced row; throughput over the finished runs (a crashed run's figures, which the
    playbook drew as crashed, are not a steady state) within BREAKDOWN of their group's best."""
    out = SweepMetrics()
    groups: dict = {}
    for row in rows:
        if row.estimate is None:
            out.unpriced += 1
            continue
        out.priced += 1
        out.fits_agreement += row.estimate.fits == (row.status == "ok")
        out.crashed += bool(row.measured_tokens) and row.status != "ok"
        if row.measured_tokens and row.status == "ok":
            groups.setdefault((row.model, row.nodes), []).append(row)
    out.fits_agreement /= max(1, out.priced)
    for key, runs in groups.items():
        best = max(r.measured_tokens for r in runs)
        kept = [r for r in runs if r.measured_tokens >= best / BREAKDOWN]
        out.left_out += len(runs) - len(kept)
        out.ratios += [r.predicted_tokens / r.measured_tokens for r in kept]
        if len(kept) >= 3:
            out.groups[key] = (spearman([r.predicted_tokens for r in kept],
                                        [r.measured_tokens for r in kept]), len(kept))
    return out


# ------------------------------------------------------------------------- published runs

@dataclass(frozen=True)
class PublishedRun:
    """A run as its paper reports it: the model, the layout as labkit lays it out, evaluate's
    inputs, the GPUs, the reported TFLOP/s per GPU and which FLOPs they count ("hardware":
    with the recomputed forward, Megatron-LM's eq. 3; "model": without), and the source."""

    model: object
    layout: object
    inputs: dict
    gpus: int
    tflops: float
    count: str
    source: str
    era: str | None = None          # a key of labkit.planner.ERAS: what its framework offered


def published_runs() -> dict[str, PublishedRun]:
    """The published runs labkit prices (tests/cost/test_planner.py compares them). Sources and
    what is assumed are in each `source`."""
    from labkit.models import BLOOM_176B, _megatron
    from labkit.planner import Layout

    # Megatron-LM as of 2021-22 (and Megatron-DeepSpeed): its GPT layer, attention scores
    # materialised (no FlashAttention yet): Korthikanti et al.'s accounting
    a100 = dict(gpu="a100-80gb", seq_len=2048, implementation="megatron")
    narayanan = ("Narayanan et al. 2021 (Megatron-LM, SC21), A100 80GB, 8 HDR InfiniBand ports "
                 "per node, sequence 2,048, full recomputation; TFLOP/s by their eq. 3")
    return {
        "megatron gpt-3 175b": PublishedRun(
            "gpt3-175b", Layout(tp=8, pp=12, dp=16, recompute="full"),
            dict(a100, global_batch=1536), 1536, 141, "hardware",
            narayanan + "; Table 2, PTD-P, batch 1,536, micro-batch 1", "megatron-2021"),
        "megatron 310b": PublishedRun(
            "megatron-310b", Layout(tp=8, pp=16, dp=15, recompute="full"),
            dict(a100, global_batch=2160), 1920, 155, "hardware",
            narayanan + "; Table 1 (micro-batch not printed: 1 assumed)", "megatron-2021"),
        "megatron 1t": PublishedRun(
            "megatron-1t", Layout(tp=8, pp=64, dp=6, recompute="full"),
            dict(a100, global_batch=3072), 3072, 163, "hardware",
            narayanan + "; Table 1 (micro-batch not printed: 1 assumed)", "megatron-2021"),
        "mt-nlg 530b": PublishedRun(
            _megatron("mt-nlg-530b", 20480, 105, 128, vocab=50257),
            Layout(tp=8, pp=35, dp=8, recompute="full"),
            dict(a100, global_batch=1920, framework="megatron-deepspeed"), 2240,
            126, "hardware",
            "Smith et al. 2022 (Megatron-Turing NLG 530B): 105 layers, hidden 20,480, 128 "
            "heads, sequence 2,048, batch 1,920, 280 DGX A100 nodes, TP 8 x PP 35 x DP 8, "
            "126 TFLOP/s per GPU, activation checkpointing (micro-batch 1 assumed)",
            "megatron-deepspeed-2022"),
        "opt-175b": PublishedRun(
            "gpt3-175b", Layout(tp=8, dp=124, sharding="fsdp", micro_batch=8, recompute="full"),
            dict(a100, global_batch=992, precision="fp16-mixed", framework="metaseq"), 992, 147,
            "hardware",
            "Zhang et al. 2022 (OPT, §2.4): 992 A100 80GB, FairScale FSDP with Megatron-LM TP 8 "
            "(metaseq), 'up to 147 TFLOP/s per GPU', fp16, batch 2M tokens (8 sequences per "
            "GPU, no pipeline: 124 x 8 x 2,048 = 2.03M tokens, assumed), activation "
            "checkpointing. The count is not printed: with the recomputed forward, as Megatron-LM "
            "counts, assumed (the logbook planned 33 days for 300B tokens on 1,024 GPUs: ~115 "
            "TFLOP/s without it, ~150 with it)", "metaseq-2021"),
        "llama 3 405b": PublishedRun(
            "llama3-405b", Layout(tp=8, pp=16, dp=128, sharding="fsdp", chunks=2,
                                  reshard_after_forward=False, sequence_parallel=True,
                                  recompute="none", uneven=True),
            dict(gpu="h100-sxm", global_batch=2048, seq_len=8192), 16384, 400, "model",
            "Dubey et al. 2024 (The Llama 3 Herd of Models), §3.3.2 and Table 4: TP 8, CP 1, "
            "PP 16, DP 128, sequence 8,192, 16M tokens per batch, 400 TFLOP/s (41 % MFU), "
            "without activation checkpointing, FSDP not resharding after forward, interleaved "
            "stages with one layer fewer on the first and last (V not printed: 2 assumed), "
            "production kernels"),
        "bloom 176b": PublishedRun(
            BLOOM_176B, Layout(tp=4, pp=12, dp=8, sharding="zero1", micro_batch=2,
                               recompute="full"),
            dict(a100, global_batch=2048, inter_link=OMNI_PATH, grad_accum="fp32",
                 framework="megatron-deepspeed"), 384, 150, "hardware",
            "BigScience 2022 (BLOOM-176B, tr11-176B-ml README): 384 A100 80GB, TP 4, PP 12, "
            "DP 8, ZeRO-1, micro-batch 2, batch 2,048, sequence 2,048, about 150 TFLOP/s; 4 "
            "Omni-Path 100 Gb/s links per node of 8 GPUs", "megatron-deepspeed-2022"),
    }


def price_published(**planner_kwargs) -> dict[str, tuple]:
    """name -> (PublishedRun, Estimate, predicted / reported TFLOP/s in the run's count)."""
    from labkit.planner import evaluate

    out = {}
    for name, run in published_runs().items():
        e = evaluate(run.model, run.layout, **{**run.inputs, **planner_kwargs})
        out[name] = (run, e, getattr(e, f"{run.count}_tflops_per_gpu") / run.tflops)
    return out


@dataclass(frozen=True)
class Recipe:
    """A layout a framework ships as its recipe (no throughput reported): the model, the
    layout as labkit lays it out, evaluate's inputs, and the source."""

    model: object
    layout: object
    inputs: dict
    source: str


def recipes() -> dict[str, Recipe]:
    """Layouts practitioners ship; tests/cost/test_field.py checks the planner ranks each close
    to its best."""
    from labkit.planner import Layout

    return {
        "nemo llama3-70b pretrain": Recipe(
            "llama3-70b", Layout(tp=4, pp=4, chunks=5, cp=2, dp=1, sharding="zero1",
                                 sequence_parallel=True),
            dict(gpu="h100-sxm", global_batch=512, seq_len=8192),
            "NVIDIA NeMo 2.0, nemo/collections/llm/recipes/llama3_70b.py (pretrain_recipe): 4 "
            "nodes x 8 GPUs, tensor_parallelism=4, pipeline_parallelism=4, "
            "virtual_pipeline_parallelism=5, context_parallelism=2, sequence_parallelism=True, "
            "seq_length=8192, global_batch_size=512, micro_batch_size=1, distributed fused "
            "Adam (the optimizer states sharded over DP: zero1); CP at 8K tokens in practice"),
        "nemo llama3.1-405b pretrain": Recipe(
            "llama3-405b", Layout(tp=8, pp=9, chunks=2, cp=4, dp=2, sharding="zero1",
                                  sequence_parallel=True),
            dict(gpu="h100-sxm", global_batch=512, seq_len=8192),
            "NVIDIA NeMo 2.0, nemo/collections/llm/recipes/llama31_405b.py (trainer): 72 nodes x "
            "8 GPUs, tensor_parallelism=8, pipeline_parallelism=9, "
            "virtual_pipeline_parallelism=2, context_parallelism=4, sequence_parallelism=True; "
            "pretrain_recipe: seq_length=8192, global_batch_size=512, micro_batch_size=1, "
            "distributed fused Adam (zero1): NVIDIA ships CP 4 at 8K tokens for the 405B"),
    }


def rank_in_plan(model, layout, inputs, era=None, **plan_kwargs):
    """(Comparison, Plan): where `layout` ranks in `plan` over its GPUs with `inputs`, searching
    only what its era's framework offered (`labkit.planner.ERAS`) when `era` is given."""
    from labkit.planner import ERAS, plan

    p = plan(model, layout.gpus, **inputs, **(ERAS[era] if era else {}), **plan_kwargs)
    return p.compare(layout), p
