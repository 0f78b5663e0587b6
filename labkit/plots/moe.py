"""The MoE calculator's figure: memory per GPU of a mixture-of-experts model as stacked bars, one
per expert-parallel degree ep (weights, gradients, optimizer states, activations), with the GPU's
capacity and the usable part of it (`labkit.planner.usable_memory`) as lines.

    >>> est = {ep: estimate_memory("mixtral-8x7b", seq_len=4096, dp=8, ep=ep)
    ...        for ep in (1, 2, 4, 8)}
    >>> fig = moe_memory_figure(est, capacity=80e9, usable=74.5e9, current=8)

The figure only draws numbers it is given (bytes, from `labkit.memory`); it computes none.
"""
from __future__ import annotations

from labkit.plots.memory import memory_bars


def moe_memory_figure(estimates: dict, capacity: float, usable: float, current=None,
                      capacity_label: str = "", title: str = ""):
    """Stacked bars in GB (1e9 bytes), one per {ep: MemoryEstimate}; the bar of ep=`current`
    opaque with its total above it, the others faded. capacity: the GPU's memory in bytes (a
    dashed line, named by capacity_label); usable: what a run may fill of it (a dotted line)."""
    return memory_bars({str(ep): est for ep, est in estimates.items()}, capacity, capacity_label,
                       highlight=None if current is None else str(current), title=title,
                       usable=usable,
                       xlabel="expert-parallel degree ep (routed experts split over ep GPUs)")
