"""Pictures for module 04 (ZeRO): who holds what on each rank under DDP and the three stages, the
ZeRO paper's Figure 1 recomputed from `labkit.memory`, and the ZeRO lab's per-rank bytes and
bytes per step, measured beside predicted. No torch here (layer 2).

    >>> fig = holdings_figure(dp=4)                       # DDP, ZeRO-1, -2, -3 on 4 ranks
    >>> rows = figure1_rows()                             # Psi = 7.5B, N_d = 64, K = 12
    >>> [round(r["total"] / 1e9, 1) for r in rows]        # [120.0, 31.4, 16.6, 1.9]
    >>> fig = figure1()
    >>> fig = measured_bars(result.results[0]["stages"])  # labkit.labs.zero's report
"""
from __future__ import annotations

from labkit.plots import GB, new_figure

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
# (MemoryEstimate attribute, label, colour), stacked bottom to top as in labkit.plots.memory
TERMS = (("params", "weights", "#4c72b0"), ("grads", "gradients", "#55a868"),
         ("optimizer_states", "optimizer states", "#c44e52"))
STAGE_NAMES = ("baseline", "P_os", "P_os+g", "P_os+g+p")     # the paper's row names


# Every byte drawn comes from `labkit.memory.estimate_memory` (here) or from the report passed in.
def _estimate(psi, stage, dp, precision, optimizer):
    from labkit.memory import estimate_memory

    return estimate_memory(psi, zero_stage=stage, dp=dp, precision=precision,
                           optimizer=optimizer)


# ---------------------------------------------------------------------------------------------
# who holds what

def holdings_figure(dp: int = 4, precision: str = "bf16-mixed", optimizer: str = "adamw"):
    """One panel per stage (DDP, ZeRO-1, ZeRO-2, ZeRO-3), one column per rank; in each column
    three bands (weights, gradients, optimizer states), each drawn as the dp slices of that
    state: a slice this rank holds is filled, one it does not is an empty outline. Under each
    column: what the rank holds per parameter of the model, from `estimate_memory` (bytes per
    parameter, e.g. 16 for DDP in bf16-mixed AdamW, 16/dp for ZeRO-3)."""
    from matplotlib.patches import Patch, Rectangle

    from labkit import validate

    dp = validate.positive_int("dp", dp, 16)      # a picture: at most 16 columns per panel
    fig = new_figure(2.4 * len(STAGES), 2.8)
    axes = fig.subplots(1, len(STAGES), sharey=True)
    for stage, (ax, name) in enumerate(zip(axes, STAGES)):
        est = _estimate(1, stage, dp, precision, optimizer)
        held = {"params": stage >= 3, "grads": stage >= 2, "optimizer_states": stage >= 1}
        for rank in range(dp):
            for row, (attr, _, colour) in enumerate(TERMS):
                for s in range(dp):
                    mine = (not held[attr]) or s == rank      # sharded: only slice `rank`
                    ax.add_patch(Rectangle((rank + 0.1 + 0.8 * s / dp, row + 0.1), 0.8 / dp, 0.8,
                                           facecolor=colour if mine else "white",
                                           edgecolor=colour, lw=0.5))
            ax.annotate(f"{est.model_states:.3g} B", (rank + 0.5, -0.05), ha="center",
                        va="top", fontsize=7, annotation_clip=False)
        ax.set_xlim(0, dp)
        ax.set_ylim(-0.4, len(TERMS))
        ax.set_xticks([r + 0.5 for r in range(dp)], [f"rank {r}" for r in range(dp)],
                      fontsize=7)
        ax.tick_params(axis="x", length=0, pad=14)
        ax.set_yticks([])
        ax.set_title(f"{name}: {est.model_states:.3g} B/param per rank", fontsize=8)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    fig.legend(handles=[Patch(color=c, label=f"{lab} ({b} B/param)") for (a, lab, c), b in
                        zip(TERMS, _per_param(precision, optimizer))],
               loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(f"who holds what on {dp} ranks ({precision}, {optimizer}); filled: held",
                 fontsize=9)
    return fig


def _per_param(precision, optimizer):
    from labkit.memory import state_bytes

    return state_bytes(precision, optimizer)


# ---------------------------------------------------------------------------------------------
# the ZeRO paper's Figure 1

def figure1_rows(psi: float = 7.5e9, dp: int = 64, precision: str = "bf16-mixed",
                 optimizer: str = "adamw") -> list[dict]:
    """The rows of Rajbhandari et al. 2020's Figure 1 (model states per device), from
    `estimate_memory`: for each stage its name ("baseline", "P_os", "P_os+g", "P_os+g+p"), the
    paper's formula with this precision's bytes (K = optimizer-state bytes per parameter, 12 for
    bf16-mixed AdamW) and the bytes per term and in total."""
    w, g, k = _per_param(precision, optimizer)
    formulas = (f"({w}+{g}+K) Psi", f"({w}+{g}) Psi + K Psi/N_d",
                f"{w} Psi + ({g}+K) Psi/N_d", f"({w}+{g}+K) Psi/N_d")
    rows = []
    for stage, (name, formula) in enumerate(zip(STAGE_NAMES, formulas)):
        est = _estimate(psi, stage, dp, precision, optimizer)
        rows.append(dict(stage=stage, name=name, formula=formula, K=k, params=est.params,
                         grads=est.grads, optimizer_states=est.optimizer_states,
                         total=est.model_states))
    return rows


def figure1(psi: float = 7.5e9, dp: int = 64, precision: str = "bf16-mixed",
            optimizer: str = "adamw"):
    """Figure 1 of the ZeRO paper redrawn: one horizontal stacked bar per stage (weights,
    gradients, optimizer states per device, in GB), labelled with the formula and the total."""
    rows = figure1_rows(psi, dp, precision, optimizer)
    fig = new_figure(7.5, 2.8)
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    for (attr, label, colour) in TERMS:
        lefts = [sum(r[a] for a, _, _ in TERMS[:[t[0] for t in TERMS].index(attr)]) / GB
                 for r in rows]
        ax.barh(ys, [r[attr] / GB for r in rows], left=lefts, color=colour, height=0.6,
                label=label)
    top = max(r["total"] for r in rows) / GB
    for y, r in zip(ys, rows):
        ax.annotate(f"{r['total'] / GB:.1f} GB   {r['formula']}", (r["total"] / GB, y),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(ys, [r["name"] for r in rows])
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("model states per device, GB (1 GB = 1e9 bytes)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"ZeRO Figure 1: Psi = {psi / 1e9:g}B parameters, N_d = {dp}, "
                 f"K = {rows[0]['K']} ({precision}, {optimizer})", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------
# the lab's measurements

def measured_bars(stages: dict, rank: int | None = None):
    """Per-rank model-state bytes of each implementation in a `labkit.labs.zero` report
    (`result.results[r]["stages"]`: name -> {"measured": {term: bytes}, "predicted": {...}}):
    two stacked bars per implementation, measured (solid) beside predicted (hatched), with
    the ratio of the totals above them. Bytes in MB (1e6)."""
    from matplotlib.patches import Patch

    if not isinstance(stages, dict) or not stages:
        raise ValueError("stages must be the lab's non-empty {name: {'measured': ..., "
                         "'predicted': ...}} report (result.results[rank]['stages'])")
    names = list(stages)
    fig = new_figure(max(5.0, 1.3 * len(names) + 2.5), 3.4)
    ax = fig.add_subplot()
    top = 0.0
    for i, name in enumerate(names):
        for dx, key, hatch in ((-0.2, "measured", None), (0.2, "predicted", "//")):
            bottom = 0.0
            for attr, _, colour in TERMS:
                h = stages[name][key].get(attr, 0) / 1e6
                ax.bar(i + dx, h, bottom=bottom, width=0.38, color=colour if not hatch else
                       "white", edgecolor=colour, hatch=hatch, lw=0.8)
                bottom += h
            top = max(top, bottom)
        m = sum(stages[name]["measured"].get(a, 0) for a, _, _ in TERMS)
        p = sum(stages[name]["predicted"].get(a, 0) for a, _, _ in TERMS)
        ax.annotate(f"x{m / p:.3f}" if p else "-", (i, max(m, p) / 1e6), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, top * 1.2 if top else 1)
    ax.set_ylabel("MB on this rank (1 MB = 1e6 bytes)")
    handles = [Patch(color=c, label=lab) for _, lab, c in TERMS]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                         label="predicted (estimate_memory)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    ax.set_title("model states per rank: measured (left) vs predicted (right)"
                 + (f", rank {rank}" if rank is not None else ""), fontsize=9)
    return fig


def communication_bars(stages: dict):
    """Bytes per step of each implementation in a `labkit.labs.zero` report, three bars each:
    the payload its collectives carried (S, measured) beside `step_communication`'s, and what
    one rank put on the wire: a ring's figure (`wire.predicted_ring`) and what gloo's sockets
    took (`wire.sent`, when measured; gloo runs a reduce-scatter as an all-reduce). MB (1e6)."""
    if not isinstance(stages, dict) or not stages:
        raise ValueError("stages must be the lab's non-empty {name: {...}} report "
                         "(result.results[rank]['stages'])")
    names = list(stages)
    bars = (("payload", "payload measured", "#4c72b0", None),
            ("predicted_payload", "payload predicted (step_communication)", "white", "//"),
            ("ring", "wire per rank, ring (NCCL-like)", "#999999", None),
            ("sent", "wire per rank, measured (gloo)", "#D55E00", None))
    fig = new_figure(max(5.0, 1.4 * len(names) + 3.0), 3.4)
    ax = fig.add_subplot()
    for j, (key, label, colour, hatch) in enumerate(bars):
        xs, hs = [], []
        for i, name in enumerate(names):
            s = stages[name]
            value = s["wire"]["predicted_ring"] if key == "ring" else \
                s["wire"]["sent"] if key == "sent" else s[key]
            if value is not None:
                xs.append(i + (j - 1.5) * 0.2)
                hs.append(value / 1e6)
        ax.bar(xs, hs, width=0.2, color=colour, edgecolor="#4c72b0" if hatch else colour,
               hatch=hatch, label=label)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("MB per step (1 MB = 1e6 bytes)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("communication per step: payload and bytes on the wire", fontsize=9)
    return fig
