"""Answers of the collectives questions (labkit/quiz/data/collectives.yaml), computed with
labkit.comm (alpha-beta times, nccl-tests' algbw/busbw) and labkit.hardware's link table."""
from __future__ import annotations

import math

from labkit.comm import bus_factor, bytes_sent_per_rank, collective_time
from labkit.hardware import LINKS

GB = 1e9


def ring_bytes_per_rank_gb(op, size_gb, n):
    """Bytes each rank sends in a ring `op` of nccl-tests' size S over n ranks, GB."""
    sent = bytes_sent_per_rank(op, size_gb * GB, n)
    return {"answer": sent / GB, "factor": bus_factor(op, n)}


def allreduce_seconds(size_gb, n, link, latency=False):
    """Ring all-reduce time of size_gb GB on n ranks over `link` (per-direction bandwidth;
    latency term only if `latency`), seconds; with the bidirectional figure's (wrong) time."""
    L = LINKS[link]
    alpha = L.latency if latency else 0.0
    t = collective_time("all_reduce", size_gb * GB, n, L.bandwidth, alpha)
    return {"answer": t, "ms": t * 1e3, "bw_gb": L.bandwidth / GB, "bidir_gb": L.bidirectional / GB,
            "factor": bus_factor("all_reduce", n),
            "bidir_s": collective_time("all_reduce", size_gb * GB, n, L.bidirectional),
            "ten_x": 10 * t}


def collective_ms(op, size_mb, n, link):
    """Ring `op` time of nccl-tests' size size_mb MB on n ranks over `link`, latency included,
    milliseconds; with its bandwidth and latency terms apart."""
    L = LINKS[link]
    t = collective_time(op, size_mb * 1e6, n, L.bandwidth, L.latency)
    bw_only = collective_time(op, size_mb * 1e6, n, L.bandwidth, 0.0)
    return {"answer": t * 1e3, "bw_ms": bw_only * 1e3, "lat_us": (t - bw_only) * 1e6,
            "alpha_us": L.latency * 1e6, "bw_gb": L.bandwidth / GB,
            "factor": bus_factor(op, n)}


def busbw_gbps(op, size_mb, n, time_ms):
    """nccl-tests' busbw from a measured time: algbw = S / t, busbw = algbw x factor, GB/s."""
    from labkit.comm import algbw, bus_bandwidth
    S, t = size_mb * 1e6, time_ms * 1e-3
    return {"answer": bus_bandwidth(op, S, t, n) / GB, "algbw": algbw(S, t) / GB,
            "factor": bus_factor(op, n)}


def factor(op, n):
    """nccl-tests' busbw / algbw factor."""
    return {"answer": bus_factor(op, n), "n_minus_1": n - 1}


def ring_steps(op, n):
    """Messages each rank sends one after another in a ring `op` on n ranks: the latency term's
    multiplier, read from collective_time with 1 s of latency and an empty message."""
    return {"answer": round(collective_time(op, 0, n, 1.0, latency=1.0)), "n_minus_1": n - 1}


def ring_vs_tree_latency(n):
    """Ratio of the latency terms of a ring and a (double binary) tree all-reduce on n ranks."""
    ring = collective_time("all_reduce", 0, n, 1.0, latency=1.0, algorithm="ring")
    tree = collective_time("all_reduce", 0, n, 1.0, latency=1.0, algorithm="tree")
    return {"answer": ring / tree, "ring": round(ring), "tree": round(tree),
            "log2n": math.ceil(math.log2(n))}


def allreduce_is_rs_plus_ag(n, size_gb):
    """A ring all-reduce sends exactly a reduce-scatter plus an all-gather, and takes as long."""
    S = size_gb * GB
    ar = bytes_sent_per_rank("all_reduce", S, n)
    parts = bytes_sent_per_rank("reduce_scatter", S, n) + bytes_sent_per_rank("all_gather", S, n)
    t_ar = collective_time("all_reduce", S, n, 1e11, 1e-6)
    t_parts = (collective_time("reduce_scatter", S, n, 1e11, 1e-6)
               + collective_time("all_gather", S, n, 1e11, 1e-6))
    return {"holds": math.isclose(ar, parts) and math.isclose(t_ar, t_parts),
            "ar_gb": ar / GB, "half_gb": parts / 2 / GB}


def ring_time_grows_with_n(small_kb, large_gb, link):
    """Ring all-reduce: the bandwidth term is nearly flat in N (S/B at 2 ranks to 2S/B), the
    latency term 2(N-1) alpha is not: a small message at 1024 ranks takes far longer than at 8,
    a large one less than twice as long."""
    L = LINKS[link]

    def t(size, n):
        return collective_time("all_reduce", size, n, L.bandwidth, L.latency)
    small = t(small_kb * 1e3, 1024) / t(small_kb * 1e3, 8)
    large = t(large_gb * GB, 1024) / t(large_gb * GB, 8)
    return {"holds": small > 10 and large < 2, "small_ratio": small, "large_ratio": large,
            "alpha_us": L.latency * 1e6}


def allreduce_ms(size_gb, n, link):
    """`allreduce_seconds` in milliseconds (latency ignored)."""
    out = allreduce_seconds(size_gb, n, link)
    return {**out, "answer": out["ms"]}
