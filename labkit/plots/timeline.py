"""The DDP step as a timeline (module 03): backward compute beside the all-reduces, one pair of
lanes per implementation, from the events `labkit.labs.ddp --part compare` reports (their
shape: the comment above `KEYS`).

    fig = timeline_figure({"naive": events, "bucketed": events2})   # top to bottom
    summarize(events)        # compute_end, comm_busy, comm_hidden, exposed, overlap (seconds)

`summarize` gives the figures the lesson quotes (how much of the communication the backward hid,
how much was left exposed after it). Pure Python over the reported numbers: no torch.
"""
from __future__ import annotations

from labkit.plots import new_figure

COMPUTE = "#0072B2"      # forward and backward compute
COMM = "#D55E00"         # all-reduce in flight
READY = "#000000"        # a gradient became ready

# One implementation's events (seconds from the start of the step, on one rank):
#     {"forward_end": t,                          # the loss is computed
#      "grads": [[name, t], ...],                 # when each parameter's gradient was ready
#      "allreduce": [[start, end, bytes], ...],   # each all-reduce: issued, completed
#      "sync_end": t,                             # every gradient averaged (after the last wait)
#      "step_end": t}                             # the optimizer step done
KEYS = ("forward_end", "grads", "allreduce", "sync_end", "step_end")


def _check(name: str, events) -> None:
    if not isinstance(events, dict) or any(k not in events for k in KEYS):
        got = sorted(events) if isinstance(events, dict) else type(events).__name__
        raise ValueError(f"events[{name!r}] must be a dict with keys {', '.join(KEYS)} (what "
                         f"labkit.labs.ddp reports as 'timeline'); got {got}")


def union(intervals) -> list[tuple[float, float]]:
    """Merged, sorted (start, end) intervals: the time at least one of them covers."""
    merged: list[list[float]] = []
    for start, end in sorted((float(s), float(e)) for s, e in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def summarize(events: dict) -> dict:
    """Seconds, from one implementation's events:
    compute_end: the last gradient ready (backward compute over);
    comm_busy: time with at least one all-reduce in flight;
    comm_hidden: the part of comm_busy before compute_end (overlapped with the backward);
    exposed: sync_end - compute_end (waiting for communication once the backward is over);
    overlap: comm_hidden / comm_busy (0 when nothing is sent)."""
    _check("events", events)
    compute_end = max((float(t) for _, t in events["grads"]), default=events["forward_end"])
    busy = union((s, e) for s, e, _ in events["allreduce"])
    comm_busy = sum(e - s for s, e in busy)
    hidden = sum(max(0.0, min(e, compute_end) - s) for s, e in busy)
    return dict(compute_end=compute_end, comm_busy=comm_busy, comm_hidden=hidden,
                exposed=max(0.0, float(events["sync_end"]) - compute_end),
                overlap=hidden / comm_busy if comm_busy > 0 else 0.0,
                step=float(events["step_end"]), allreduces=len(events["allreduce"]))


def timeline_figure(timelines: dict, title: str | None = None):
    """A Figure: for each implementation (dict order, top to bottom) a compute lane (forward,
    backward up to the last gradient, a tick where each gradient became ready) and an
    all-reduce lane (one bar per call, issued to completed), in milliseconds from the step's
    start; a dashed line where the gradients were all averaged."""
    if not isinstance(timelines, dict) or not timelines:
        raise ValueError("timelines must be a non-empty dict {implementation: events}; got "
                         f"{type(timelines).__name__}")
    for name, ev in timelines.items():
        _check(name, ev)
    n = len(timelines)
    fig = new_figure(8.0, 0.9 + 0.75 * n)
    ax = fig.add_subplot()
    ms = 1e3
    labels, ticks = [], []
    for i, (name, ev) in enumerate(timelines.items()):
        s = summarize(ev)
        y = 2 * (n - 1 - i)
        fwd = ev["forward_end"] * ms
        ax.broken_barh([(0, fwd)], (y + 1.05, 0.8), facecolors=COMPUTE, alpha=0.45)
        ax.broken_barh([(fwd, s["compute_end"] * ms - fwd)], (y + 1.05, 0.8), facecolors=COMPUTE)
        ax.vlines([t * ms for _, t in ev["grads"]], y + 1.05, y + 1.85, colors=READY, lw=0.6)
        ax.broken_barh([(a * ms, max(b - a, 0) * ms) for a, b, _ in ev["allreduce"]],
                       (y + 0.15, 0.8), facecolors=COMM, edgecolors="white", linewidth=0.4)
        ax.vlines(ev["sync_end"] * ms, y + 0.05, y + 1.95, colors="grey", linestyles="dashed")
        labels += [f"{name}: all-reduce", f"{name}: compute"]
        ticks += [y + 0.55, y + 1.45]
        ax.text(ev["step_end"] * ms, y + 0.55,
                f"  {s['allreduces']} calls, {100 * s['overlap']:.0f}% hidden, "
                f"{s['exposed'] * ms:.1f} ms exposed", va="center", fontsize=7)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms from the start of the step (light: forward; dark: backward; ticks: "
                  "gradient ready; dashed: gradients averaged)", fontsize=8)
    right = max(ev["step_end"] for ev in timelines.values()) * ms
    ax.set_xlim(0, right * 1.45 if right > 0 else 1)
    ax.set_ylim(-0.1, 2 * n)
    ax.set_title(title or "One DDP step: backward compute vs all-reduce", fontsize=10)
    return fig
