"""Checkpointing at scale: how big a checkpoint is, how long it takes to write, how often a job
fails, and how often to checkpoint.

    >>> size = checkpoint_bytes("llama3-70b")                 # fp32 master + AdamW: 12 B/param
    >>> t = write_seconds(size, 100e9)                         # at 100 GB/s aggregate
    >>> mtbf = job_mtbf(gpus=16_000, daily_failure_rate=1e-4)  # seconds between failures
    >>> young_daly_interval(mtbf, t), overhead(young_daly_interval(mtbf, t), t, mtbf)

Sources: torch.distributed.checkpoint (what DCP saves), J. W. Young, CACM 17(9), 1974, and
J. T. Daly, FGCS 22(3), 2006 (the interval, to higher order); each formula is in its function.
Pure Python.
"""
from __future__ import annotations

import math
import numbers

from labkit import validate
from labkit.models import get_model

DAY = 86_400.0
KINDS = {"training": 12, "export": 2}     # bytes per parameter: fp32 + AdamW; bf16 weights
MAX_SECONDS = 1e12                        # ~30,000 years: beyond any job
# Measured (A. Grattafiori et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): 419
# unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = {"interruptions": 419, "days": 54, "gpus": 16_384}


def checkpoint_bytes(model, kind: str = "training") -> float:
    """Bytes of one checkpoint of `model` (a preset name, ModelSpec, transformers config or a
    parameter count): kind "training" 12 B/param (fp32 weights + AdamW's two fp32 moments, what
    DCP saves for FSDP2 + AdamW), "export" 2 B/param (bf16 weights only).

    "training" is what `torch.distributed.checkpoint` (DCP) saves for a run with FSDP2's fp32
    sharded parameters and AdamW: the fp32 weights (4 B/param, the master copy) and the two
    fp32 moments (8 B/param); AdamW's per-tensor `step` counters are a few bytes, not counted.
    "export" is for inference."""
    validate.choice("kind", kind, KINDS)
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        n = validate.positive("model (parameter count)", model, validate.MAX_PARAMS)
    else:
        n = get_model(model).num_params()
    return float(KINDS[kind] * n)


def write_seconds(nbytes, bandwidth, *, nodes: int = 1, per_node: bool = False) -> float:
    """Seconds to write `nbytes` at `bandwidth` bytes/s: the storage's aggregate bandwidth
    (per_node=False; the nodes share it), or each node's own (per_node=True: `nodes` nodes write
    their shards in parallel, nodes x bandwidth in all)."""
    size = validate.positive("nbytes", nbytes, validate.MAX_BYTES)
    bw = validate.at_least("bandwidth", bandwidth, validate.MIN_BANDWIDTH, validate.MAX_BYTES)
    n = validate.positive_int("nodes", nodes, validate.MAX_RANKS)
    validate.choice("per_node", per_node, (False, True))
    return size / (bw * (n if per_node else 1))


def failures_per_day(gpus: int, daily_failure_rate: float) -> float:
    """Expected failures a day of a job on `gpus` GPUs, each failing with probability
    `daily_failure_rate` a day (a fraction: 0.01 % is 1e-4), independently."""
    g = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    r = validate.positive("daily_failure_rate", daily_failure_rate, 1.0)
    return g * r


def measured_failure_rate(interruptions: int, days: float, gpus: int) -> float:
    """The failure rate per GPU per day (a fraction) that `interruptions` over `days` on `gpus`
    GPUs imply: interruptions / (days x gpus). Llama 3's 419 in 54 days on 16,384 GPUs is
    4.74e-4, about 0.047 %/GPU/day (every unexpected interruption counted as one GPU's)."""
    n = validate.positive("interruptions", interruptions, 1e12)
    d = validate.positive("days", days, 1e6)
    g = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    return n / (d * g)


LLAMA3_FAILURE_RATE = measured_failure_rate(**LLAMA3_INTERRUPTIONS)


def job_mtbf(gpus: int, daily_failure_rate: float) -> float:
    """Mean time between failures of the whole job, in seconds: one day / (gpus x rate).

    A job of G GPUs, each failing at r per day independently, fails G x r times a day; its MTBF
    is 1 / (G r) days. 0.01 %/GPU/day on 1,000 GPUs is 0.1 failures a day, one every 10 days
    (not "every 10 hours"); on 16,000 GPUs, 1.6 a day, one every 15 hours."""
    return DAY / failures_per_day(gpus, daily_failure_rate)


def young_daly_interval(mtbf, write_time, order: int = 1) -> float:
    """The checkpoint interval (seconds of work between checkpoints) that minimises the time
    lost, for write_time delta and mtbf M. Order 1, Young (1974): sqrt(2 delta M). Order 2,
    Daly's higher-order estimate (2006): sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) +
    (1/9) (delta / 2M)] - delta while delta < 2M, and M once delta >= 2M. Daly's own figures
    at delta = 5 min: M = 24 h, 117 min; M = 6 h, 57 min; M = 15 min, 9.1 min.

    J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9), 1974; J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006,
    doi:10.1016/j.future.2004.11.016."""
    m = validate.positive("mtbf", mtbf, MAX_SECONDS)
    d = validate.positive("write_time", write_time, MAX_SECONDS)
    validate.choice("order", order, (1, 2))
    tau = math.sqrt(2 * d * m)
    if order == 1:
        return tau
    if d >= 2 * m:                       # writing takes longer than two MTBFs: Daly's tau = M
        return m
    x = d / (2 * m)
    return tau * (1 + math.sqrt(x) / 3 + x / 9) - d


def overhead(interval, write_time, mtbf, restart_seconds=0.0) -> float:
    """Expected fraction of time lost at checkpoint `interval` (first order): writing,
    write_time / interval, plus the work lost per failure, half an interval, interval /
    (2 mtbf), plus restart_seconds / mtbf. At Young's interval the first two terms are equal
    and the overhead is sqrt(2 write_time / mtbf)."""
    tau = validate.positive("interval", interval, MAX_SECONDS)
    d = validate.non_negative("write_time", write_time, MAX_SECONDS)
    m = validate.positive("mtbf", mtbf, MAX_SECONDS)
    r = validate.non_negative("restart_seconds", restart_seconds, MAX_SECONDS)
    return d / tau + tau / (2 * m) + r / m
