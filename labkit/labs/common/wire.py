"""What a lab reads off the wire: bytes this process wrote (`bytes_written`, Linux's
/proc/self/io), and the alpha-beta fit of measured collective times (`fit_alpha_beta`) read in
labkit.comm's terms (`model_parameters`). Used by the collectives, ring, ddp and zero labs.
"""
from __future__ import annotations

import math


def fit_alpha_beta(sizes, times) -> dict:
    """Least-squares fit of t = alpha + beta * S with weights 1/t (relative errors).

    Returns {"alpha": s, "beta": s/byte, "rms_rel_err": ...}. Needs two distinct sizes."""
    pts = [(float(s), float(t)) for s, t in zip(sizes, times) if t > 0]
    if len({s for s, _ in pts}) < 2:
        raise ValueError("fitting alpha and beta needs times at two or more distinct sizes")
    # minimise sum w (alpha + beta s - t)^2 with w = 1/t^2: 2x2 normal equations
    w = [1.0 / t**2 for _, t in pts]
    sw = sum(w)
    sws = sum(wi * s for wi, (s, _) in zip(w, pts))
    swss = sum(wi * s * s for wi, (s, _) in zip(w, pts))
    swt = sum(wi * t for wi, (_, t) in zip(w, pts))
    swst = sum(wi * s * t for wi, (s, t) in zip(w, pts))
    det = sw * swss - sws * sws
    alpha = (swss * swt - sws * swst) / det
    beta = (sw * swst - sws * swt) / det
    rel = [((alpha + beta * s) - t) / t for s, t in pts]
    return {"alpha": alpha, "beta": beta,
            "rms_rel_err": math.sqrt(sum(r * r for r in rel) / len(rel))}


def model_parameters(op: str, world_size: int, fit: dict) -> dict:
    """Read a fit (t = alpha + beta S) in the cost model's terms: the per-message latency and the
    per-direction link bandwidth that make `labkit.comm.collective_time` reproduce the fitted
    line. The model's own step count and ring factor are read off `collective_time` and
    `bus_bandwidth`, so no formula is repeated here."""
    from labkit.comm import bus_bandwidth, collective_time

    # messages in the latency term: the model's time with latency 1 s and a huge bandwidth
    steps = collective_time(op, nbytes=1.0, world_size=world_size, bandwidth=1e30, latency=1.0)
    factor = bus_bandwidth(op, 1.0, 1.0, world_size)          # busbw / algbw
    bandwidth = factor / fit["beta"] if fit["beta"] > 0 else float("inf")
    latency = fit["alpha"] / steps if steps > 0 else 0.0
    return {"latency": latency, "bandwidth": bandwidth, "steps": steps, "factor": factor}


def bytes_written() -> int | None:
    """Bytes this process has passed to write/send system calls so far: `wchar` of Linux's
    /proc/self/io (all threads, so gloo's socket writes count). None where there is no /proc."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
