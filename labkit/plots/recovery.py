"""When a node dies (module 05): progress against wall time for each recovery strategy, measured,
beside a run without failure.

    fig = progress_figure([relaunch, elastic, torchft])   # what each lab's measure() returns

Each run is a dict with "strategy", "step_end" (seconds from the first step's start to the end
of each committed step), "step_seconds", "killed_at_step" and, where known, "killed_at_seconds"
(labkit.labs.elastic.measure, labkit.labs.ft.measure). The gap between a strategy's line and the dashed no-failure line at the
end is the time it lost. No torch here (layer 2).
"""
from __future__ import annotations

import math

from labkit.plots import new_figure

COLOURS = {"relaunch": "#D55E00", "elastic": "#0072B2", "torchft": "#009E73"}
KEYS = ("strategy", "step_end", "step_seconds", "killed_at_step")


def _check(runs) -> list[dict]:
    runs = list(runs)
    if not runs:
        raise ValueError("no runs to draw; allowed: the dicts labkit.labs.elastic.measure and "
                         "labkit.labs.ft.measure return")
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or any(k not in run for k in KEYS):
            raise ValueError(f"run {i} must be a dict with keys {', '.join(KEYS)} (what the "
                             f"recovery labs' measure() returns); got {str(run)[:120]}")
        ends = run["step_end"]
        if not ends or any(not math.isfinite(float(t)) for t in ends):
            raise ValueError(f"run {i} ({run['strategy']}): step_end must hold a finite time "
                             "per committed step")
    return runs


def lost_seconds(run: dict) -> float:
    """Wall time the run lost against one without failure: its last step's end minus
    steps x step_seconds."""
    return float(run["step_end"][-1]) - len(run["step_end"]) * float(run["step_seconds"])


def progress_figure(runs, *, title: str = "Steps done against wall time, one rank killed"):
    """A Figure: committed steps against seconds for each run, the no-failure line dashed,
    the kill marked on each line."""
    runs = _check(runs)
    fig = new_figure(7.0, 3.6)
    ax = fig.subplots()
    longest = max(len(r["step_end"]) for r in runs)
    pace = min(float(r["step_seconds"]) for r in runs)
    ax.plot([0, longest * pace], [0, longest], ls="--", color="grey", lw=1,
            label="no failure")
    for run in runs:
        name = run["strategy"]
        ends = [float(t) for t in run["step_end"]]
        ax.step([0.0] + ends, range(len(ends) + 1), where="post", color=COLOURS.get(name),
                label=f"{name}: lost {lost_seconds(run):.1f} s")
        t = run.get("killed_at_seconds")
        if t is not None:                    # steps committed when the kill came
            ax.plot([t], [sum(e <= t for e in ends)], marker="x", ms=9, mew=2,
                    color=COLOURS.get(name))
    ax.set_xlabel("seconds since the first step began")
    ax.set_ylabel("steps kept (a redone step once)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title + " (x: the kill)", fontsize=11)
    return fig
