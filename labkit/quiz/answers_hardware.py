"""Answers of the hardware questions (labkit/quiz/data/hardware.yaml), read from labkit.hardware
(GPUS, LINKS: each figure with its source) and labkit.models."""
from __future__ import annotations

from labkit.hardware import GB, GPUS, LINKS, GiB
from labkit.models import get_model


def link_gbps(link):
    """Per-direction bandwidth of a link in GB/s, and the vendor's words."""
    L = LINKS[link]
    return {"answer": L.bandwidth / GB, "quoted": L.quoted, "bidir": L.bidirectional / GB,
            "bits": L.bandwidth * 8 / 1e9}


def link_bidirectional(link):
    """Both directions added, GB/s (what NVLink and PCIe marketing quote)."""
    L = LINKS[link]
    return {"answer": L.bidirectional / GB, "per_dir": L.bandwidth / GB, "quoted": L.quoted}


def link_ratio(fast, slow):
    """Per-direction bandwidth ratio of two links."""
    a, b = LINKS[fast], LINKS[slow]
    return {"answer": a.bandwidth / b.bandwidth, "fast_gb": a.bandwidth / GB,
            "slow_gb": b.bandwidth / GB, "fast_bidir": a.bidirectional / GB,
            "slow_bidir": b.bidirectional / GB,
            "hdr_ratio": a.bandwidth / LINKS["ib-hdr"].bandwidth}


def peak_tflops(gpu, dtype):
    """Dense tensor-core peak, TFLOP/s (datasheets print twice that 'with sparsity')."""
    g = GPUS[gpu]
    return {"answer": g.flops(dtype) / 1e12, "sparse": 2 * g.flops(dtype) / 1e12,
            "name": g.name}


def memory_gib(gpu):
    """A GPU's labelled memory (GB = 1e9 bytes) in GiB (2**30 bytes)."""
    g = GPUS[gpu]
    return {"answer": g.memory / GiB, "gb": g.memory / GB, "name": g.name}


def weights_read_ms(model, gpu, bytes_per_value=2):
    """Time to stream all weights of `model` once from HBM at the GPU's memory bandwidth, ms."""
    n = get_model(model).num_params()
    g = GPUS[gpu]
    return {"answer": n * bytes_per_value / g.memory_bandwidth * 1e3,
            "weights_gb": n * bytes_per_value / GB, "hbm": g.memory_bandwidth / 1e12}

