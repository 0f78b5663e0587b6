"""Figures of the evidence of module 09's "diagnose this run" cases (labkit.labs.diagnose): what a
learner would look at when a run is slow or dies. Pure drawing over the reported numbers (seconds,
bytes); no torch.

    from labkit.plots import diagnose, png_bytes
    fig = diagnose.evidence_figure(case.evidence)          # case.figure() gives its PNG bytes

Evidence keys drawn, a panel each when present: "step_times", "timeline", "pipeline", "memory"
(their shapes: `evidence_figure`).
"""
from __future__ import annotations

from labkit.plots import GB, GiB, new_figure

KIND_COLORS = {"forward": "#0072B2", "extra work": "#CC79A7", "backward": "#D55E00",
               "optimizer": "#009E73", "compute": "#0072B2", "all_reduce": "#E69F00",
               "barrier": "#999999", "waiting": "#E69F00"}
MEMORY_COLORS = {"parameters": "#0072B2", "gradients": "#56B4E9", "optimizer states": "#009E73",
                 "activations": "#D55E00"}
MS = 1e3
MB, MiB = 1e6, 2**20


def fmt_size(n: float) -> str:
    """Bytes as a person reads them, in both units: '21.86 MB (20.85 MiB)', or in GB/GiB from
    1e9 bytes on (a tiny lab model's bytes would all read 0.00 GB)."""
    if abs(n) >= GB:
        return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"
    return f"{n / MB:,.2f} MB ({n / MiB:,.2f} MiB)"


def _check_events(events) -> list[dict]:
    if not isinstance(events, (list, tuple)):
        raise ValueError(f"timeline must be a list of events; got {type(events).__name__}")
    for e in events:
        if not isinstance(e, dict) or any(k not in e for k in ("rank", "kind", "start", "end")):
            raise ValueError(f"timeline event {e!r} must be a dict with rank, kind, start, end")
        if e["end"] < e["start"]:
            raise ValueError(f"timeline event {e!r} ends before it starts; allowed: end >= start")
    return list(events)


def draw_step_times(ax, step_times: dict, fault_from: int | None = None) -> None:
    """Each label's step times (ms) against the step's index; a dashed line at `fault_from`."""
    if not isinstance(step_times, dict) or not step_times:
        raise ValueError("step_times must be a non-empty dict {label: [seconds per step]}")
    for label, times in step_times.items():
        ax.plot(range(len(times)), [MS * t for t in times], marker="o", markersize=3,
                label=str(label))
    if fault_from is not None:
        ax.axvline(fault_from - 0.5, color="black", linestyle="--", linewidth=1)
        ax.text(fault_from - 0.4, ax.get_ylim()[1], " fault from here", va="top", fontsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("timed step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best", framealpha=0.8)
    ax.set_title("step time per step", fontsize=10)


def draw_timeline(ax, events, title: str = "timeline") -> None:
    """One lane per event's "lane" (default "rank R"), in order of appearance, top to bottom."""
    rows = _check_events(events)
    lanes: list[str] = []
    for e in rows:
        lane = str(e.get("lane", f"rank {e['rank']}"))
        if lane not in lanes:
            lanes.append(lane)
    t0 = min((e["start"] for e in rows), default=0.0)
    seen = set()
    for e in rows:
        y = lanes.index(str(e.get("lane", f"rank {e['rank']}")))
        kind = e["kind"]
        waiting = kind.startswith("waiting")
        base = kind.split(" in ", 1)[1] if waiting and " in " in kind else kind
        color = KIND_COLORS.get(base, "#777777")
        label = None if kind in seen else kind
        seen.add(kind)
        ax.barh(y, MS * (e["end"] - e["start"]), left=MS * (e["start"] - t0), height=0.7,
                color="white" if waiting else color, edgecolor=color if waiting else "white",
                linewidth=0.8, hatch="//" if waiting else "", label=label)
        if waiting:
            ax.text(MS * ((e["start"] + e["end"]) / 2 - t0), y, kind + (
                f" (step {e['step']})" if "step" in e else ""), ha="center", va="center",
                fontsize=8, bbox=dict(facecolor="white", edgecolor="none", pad=1))
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False,
              ncols=max(1, len(seen)))


def draw_memory(ax, memory: dict) -> None:
    """Stacked bytes per micro-batch by category, the budget as a red line; the micro-batch that
    failed drawn hatched (what it would have needed, as the evidence gives it)."""
    if not isinstance(memory, dict) or "budget" not in memory or "by_batch" not in memory:
        raise ValueError("memory must be a dict with 'budget' (bytes) and 'by_batch' "
                         "{micro-batch: {category: bytes}}")
    by_batch = memory["by_batch"]
    xs = list(by_batch)
    unit, name = (GB, "GB") if memory["budget"] >= GB else (MB, "MB")
    for i, b in enumerate(xs):
        bottom = 0.0
        failed = str(b) == str(memory.get("failed"))
        for cat, n in by_batch[b].items():
            ax.bar(i, n / unit, bottom=bottom / unit, color=MEMORY_COLORS.get(cat, "#777777"),
                   hatch="//" if failed else "", edgecolor="white",
                   label=cat if i == 0 else None)
            bottom += n
    ax.axhline(memory["budget"] / unit, color="red", linestyle="--", linewidth=1.2)
    ax.text(-0.4, memory["budget"] / unit, f"budget {fmt_size(memory['budget'])}",
            ha="left", va="bottom", fontsize=8, color="red")
    ax.set_xticks(range(len(xs)), [f"{b}" + (" (failed)" if str(b) == str(memory.get("failed"))
                                              else "") for b in xs])
    ax.set_xlabel("micro-batch (sequences)")
    ax.set_ylabel(f"{name} per rank")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("memory per rank by category", fontsize=10)


def evidence_figure(evidence: dict):
    """A Figure with a panel for each drawable key of `evidence`, or None when it has none.

    Keys drawn (each optional; a panel per key present):
    - "step_times": {label: [seconds per step]} (a label per rank, or per configuration), with
      "fault_from" (the first step index with the fault, a dashed line) when it applies;
    - "timeline": [{"rank", "kind", "start", "end"[, "lane"]}, ...]: one lane per "lane"
      (default "rank R"), one bar per event, coloured by kind, in milliseconds;
    - "pipeline": {label: [{"stage", "kind", "microbatch", "chunk", "start", "end"}, ...]}: one
      Gantt panel per run (labkit.plots.pp.draw) on one time scale;
    - "memory": {"budget": bytes, "by_batch": {micro-batch: {category: bytes}}, "failed":
      micro-batch or None}: stacked bars per micro-batch against the budget line."""
    if not isinstance(evidence, dict):
        raise ValueError(f"evidence must be a dict; got {type(evidence).__name__}")
    panels = [k for k in ("step_times", "memory", "timeline") if k in evidence]
    pipeline = evidence.get("pipeline") or {}
    n = len(panels) + len(pipeline)
    if n == 0:
        return None
    fig = new_figure(8.0, 2.6 * n)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    i = 0
    for key in panels:
        if key == "step_times":
            draw_step_times(axes[i], evidence["step_times"], evidence.get("fault_from"))
        elif key == "memory":
            draw_memory(axes[i], evidence["memory"])
        else:
            draw_timeline(axes[i], evidence["timeline"], evidence.get("timeline_title",
                                                                      "timeline"))
        i += 1
    if pipeline:
        from labkit.pipeline import as_events
        from labkit.plots.pp import draw

        runs = {k: as_events(v) for k, v in pipeline.items()}
        span = max(max(e.end for e in r) - min(e.start for e in r) for r in runs.values())
        for label, rows in runs.items():
            draw(axes[i], rows, label, span=span)
            axes[i].set_xlabel("seconds")
            i += 1
    return fig
