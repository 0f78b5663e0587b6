"""Pictures for module 05's crash lab (labkit.labs.checkpoint): the loss curve of an
uninterrupted run beside the run that crashed and its resumption, with the checkpoints, the
crash and the resume marked.

    >>> fig = resume_figure(full["losses"], crashed=crash_report, resumed=resumed_report)
    >>> max_difference(full["losses"], resumed_report["losses"], after=4)     # 0.0: exact

`losses` are the lab's report: a list of [step, loss]. No torch here (layer 2).
"""
from __future__ import annotations

import math

from labkit.plots import new_figure


def _pairs(name: str, losses) -> list[tuple[int, float]]:
    try:
        pairs = [(int(s), float(v)) for s, v in losses]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of [step, loss] pairs (the lab's 'losses'); "
                         f"got {str(losses)[:80]}") from None
    if not pairs or any(not math.isfinite(v) for _, v in pairs):
        raise ValueError(f"{name} must hold at least one [step, loss] with a finite loss")
    return pairs


def max_difference(reference, other, after: int = 0) -> float:
    """The largest |loss difference| over the steps after `after` that both runs have
    (0.0: equal step for step)."""
    ref = dict(_pairs("reference", reference))
    common = [(ref[s], v) for s, v in _pairs("other", other) if s > after and s in ref]
    if not common:
        raise ValueError(f"no step after {after} is in both runs; allowed: runs that share steps")
    return max(abs(a - b) for a, b in common)


def resume_figure(uninterrupted, crashed: dict | None = None, resumed: dict | None = None,
                  crash_step: int | None = None):
    """The uninterrupted run's loss per step (a line); the crashed run's steps (dots) up to the
    crash, the resumed run's steps after its checkpoint (crosses); dotted lines at the steps the
    crashed run checkpointed, a red line at the crash (crash_step, or the step after the last
    one the crashed run reported) and a green one at the resume. The title gives the largest
    difference between the resumed and the uninterrupted losses."""
    base = _pairs("uninterrupted", uninterrupted)
    fig = new_figure(7.0, 3.5)
    ax = fig.add_subplot()
    ax.plot([s for s, _ in base], [v for _, v in base], "-", color="#4c72b0", lw=1.5,
            label="uninterrupted")
    title = "loss per step"
    if crashed is not None:
        done = _pairs("crashed['losses']", crashed["losses"])
        ax.plot([s for s, _ in done], [v for _, v in done], "o", color="#dd8452", ms=5,
                label="crashed run")
        for i, s in enumerate(crashed.get("saves", [])):
            ax.axvline(s, color="grey", ls=":", lw=1, label="checkpoint" if i == 0 else None)
        crash_step = crash_step or done[-1][0] + 1
    if crash_step is not None:
        ax.axvline(crash_step, color="#c44e52", lw=1.5, label=f"crash (step {crash_step})")
    if resumed is not None:
        start = resumed.get("resumed_from") or 0
        new = [(s, v) for s, v in _pairs("resumed['losses']", resumed["losses"]) if s > start]
        ax.plot([s for s, _ in new], [v for _, v in new], "x", color="#55a868", ms=8, mew=2,
                label=f"resumed on {resumed.get('world_size', '?')} ranks")
        ax.axvline(start + 0.5, color="#55a868", lw=1.5, ls="--",
                   label=f"resume from step {start}")
        if new:
            diff = max_difference(base, new, after=start)
            title += f"; resumed vs uninterrupted: max |diff| {diff:.1e}" + \
                (" (exact)" if diff == 0 else "")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig
