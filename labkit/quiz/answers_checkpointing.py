"""Answers of the checkpointing and failure questions (labkit/quiz/data/checkpointing.yaml).

Sizes from `labkit.resilience.checkpoint_bytes` (training: fp32 weights + AdamW's two moments,
12 B/param; export: bf16 weights, 2 B/param), write times from `write_seconds`, failures from
`failures_per_day` / `job_mtbf` (G GPUs at r per GPU per day fail G r times a day), intervals
from `young_daly_interval` (Young 1974: sqrt(2 delta M); Daly 2006: sqrt(2 delta M)
[1 + sqrt(x)/3 + x/9] - delta with x = delta / 2M, while delta < 2M) and the time lost from
`overhead` (delta / tau + tau / (2 M) + R / M). Failure rates are given in % per GPU per day in
the questions (0.01 % = 1e-4) and converted here.
"""
from __future__ import annotations

from labkit.models import get_model
from labkit.resilience import (DAY, checkpoint_bytes, failures_per_day, job_mtbf, overhead,
                               write_seconds, young_daly_interval)

GB, HOUR, MINUTE = 1e9, 3600.0, 60.0


def _rate(rate_pct) -> float:
    return rate_pct / 100


def checkpoint_gb(model, kind="training"):
    """GB of one checkpoint of `model`."""
    n = get_model(model).num_params()
    size = checkpoint_bytes(model, kind)
    return {"answer": size / GB, "params_b": n / 1e9, "per_param": size / n,
            "export_gb": checkpoint_bytes(model, "export") / GB,
            "ratio": size / checkpoint_bytes(model, "export")}


def write_time_s(model, bandwidth_gbs, nodes=1, per_node=False):
    """Seconds to write a training checkpoint at `bandwidth_gbs` GB/s (aggregate, or per node
    with per_node=True and `nodes` nodes writing their shards in parallel)."""
    size = checkpoint_bytes(model)
    return {"answer": write_seconds(size, bandwidth_gbs * GB, nodes=nodes, per_node=per_node),
            "size_gb": size / GB, "total_gbs": bandwidth_gbs * (nodes if per_node else 1)}


def mtbf_hours(gpus, rate_pct):
    """The job's mean time between failures, in hours."""
    m = job_mtbf(gpus, _rate(rate_pct))
    return {"answer": m / HOUR, "per_day": failures_per_day(gpus, _rate(rate_pct)),
            "days": m / DAY}


def failures_in_run(gpus, rate_pct, days):
    """Expected failures over a run of `days` days."""
    per_day = failures_per_day(gpus, _rate(rate_pct))
    return {"answer": per_day * days, "per_day": per_day}


def _interval(model, gpus, rate_pct, bandwidth_gbs, order=1):
    size = checkpoint_bytes(model)
    d = write_seconds(size, bandwidth_gbs * GB)
    m = job_mtbf(gpus, _rate(rate_pct))
    return size, d, m, young_daly_interval(m, d, order)


def young_minutes(model, gpus, rate_pct, bandwidth_gbs):
    """Young's optimal checkpoint interval in minutes of work."""
    size, d, m, tau = _interval(model, gpus, rate_pct, bandwidth_gbs)
    return {"answer": tau / MINUTE, "size_gb": size / GB, "write_s": d, "mtbf_h": m / HOUR}


def daly_minutes(model, gpus, rate_pct, bandwidth_gbs):
    """Daly's higher-order interval in minutes: sqrt(2 delta M) [1 + sqrt(x)/3 + x/9] - delta,
    x = delta / 2M (delta < 2M in every draw; M from there on)."""
    size, d, m, tau = _interval(model, gpus, rate_pct, bandwidth_gbs, order=2)
    young = young_daly_interval(m, d)
    x = d / (2 * m)
    return {"answer": tau / MINUTE, "young_min": young / MINUTE, "write_s": d,
            "mtbf_h": m / HOUR, "x": x, "factor": 1 + x ** 0.5 / 3 + x / 9,
            "minus_min": (young - d) / MINUTE}


def overhead_pct(model, gpus, rate_pct, bandwidth_gbs, restart_min=0):
    """% of the time lost at Young's interval: writing + lost work (+ restarts)."""
    size, d, m, tau = _interval(model, gpus, rate_pct, bandwidth_gbs)
    r = restart_min * MINUTE
    total = overhead(tau, d, m, r)
    return {"answer": 100 * total, "write_pct": 100 * d / tau,
            "lost_pct": 100 * overhead(tau, 0.0, m), "restart_pct": 100 * r / m,
            "tau_min": tau / MINUTE, "write_s": d, "mtbf_h": m / HOUR}


def blocking_hours(write_min, every_h, days):
    """Hours each GPU stalls over `days` days when a blocking save of `write_min` minutes
    happens every `every_h` hours of training: days x 24 h x delta / tau (the writing term of
    `overhead`)."""
    tau, d = every_h * HOUR, write_min * MINUTE
    share = overhead(tau, d, DAY) - overhead(tau, 0.0, DAY)
    return {"answer": days * DAY * share / HOUR, "saves": days * DAY / tau,
            "share_pct": 100 * share}


def verify_young_scaling(gpus, factor, rate_pct=0.01, write_s=60):
    """Multiplying the GPUs by k divides the MTBF by k and Young's interval by sqrt(k)."""
    base = young_daly_interval(job_mtbf(gpus, _rate(rate_pct)), write_s)
    more = young_daly_interval(job_mtbf(gpus * factor, _rate(rate_pct)), write_s)
    ratio = base / more
    return {"holds": abs(ratio - factor ** 0.5) < 1e-9 * ratio, "ratio": ratio,
            "base_min": base / MINUTE, "more_min": more / MINUTE}
