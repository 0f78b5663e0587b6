"""Pictures for module 05 (FSDP) from the FSDP lab's reports (labkit.labs.fsdp): one step's
all-gathers, reduce-scatters and compute, unit by unit, on a time axis; and each option's
memory, bytes and step time against the default's.

    >>> r = run_lab("labkit.labs.fsdp", nproc=4, args=["--part", "timeline"]).results[0]
    >>> fig = timeline(r["runs"]["prefetch=0"]["events"], r["units"])
    >>> o = run_lab("labkit.labs.fsdp", nproc=4, args=["--part", "options"]).results[0]
    >>> fig = options_bars(o["results"])

Every number drawn comes from the report passed in. No torch here (layer 2).
"""
from __future__ import annotations

from labkit.plots import new_figure

# what -> (lane offset within a unit's pair of lanes, colour, short label)
KINDS = {"forward": (0, "#4c72b0", "F"), "backward": (0, "#dd8452", "B"),
         "all_gather": (1, "#55a868", "AG"), "reduce_scatter": (1, "#c44e52", "RS")}
EVENT_KEYS = ("what", "unit", "start", "end")


def _check_events(events, units) -> None:
    if not isinstance(events, (list, tuple)) or not events:
        raise ValueError(f"events={events!r:.80}: allowed: a non-empty list of the lab's timeline "
                         "events (dicts with 'what', 'unit', 'start', 'end')")
    for e in events:
        if not isinstance(e, dict) or any(k not in e for k in EVENT_KEYS):
            raise ValueError(f"events: {e!r:.80} is not a timeline event; allowed: dicts with "
                             f"keys {', '.join(EVENT_KEYS)}")
        if e["what"] not in KINDS:
            raise ValueError(f"events: what={e['what']!r}; allowed: {', '.join(KINDS)}")
        if e["unit"] not in units:
            raise ValueError(f"events: unit={e['unit']!r} is not in units={list(units)}")


def timeline(events, units, title: str | None = None):
    """Two lanes per FSDP unit (root on top, then block0, block1, ...): its compute (forward,
    backward) and its collectives (all-gather, reduce-scatter), each a bar from its start to
    its end, in milliseconds from the step's start. Bars of one unit overlapping bars of the
    next show prefetching (the next unit's all-gather runs while this one computes)."""
    from matplotlib.patches import Patch

    units = list(units)
    _check_events(events, units)
    order = units[-1:] + units[:-1]                        # the root first: it runs first
    fig = new_figure(8.0, 0.9 + 0.55 * len(order))
    ax = fig.subplots()
    for row, unit in enumerate(order):
        for e in events:
            if e["unit"] != unit:
                continue
            lane, colour, label = KINDS[e["what"]]
            y = 2 * row + lane
            width = max(1e3 * (e["end"] - e["start"]), 1e-3)
            ax.broken_barh([(1e3 * e["start"], width)], (y + 0.1, 0.8), facecolors=colour)
    ax.set_yticks([2 * r + lane + 0.5 for r in range(len(order)) for lane in (0, 1)])
    ax.set_yticklabels([f"{u} {what}" for u in order for what in ("compute", "comm")],
                       fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    fig.legend(handles=[Patch(color=c, label=k.replace("_", "-")) for k, (_, c, _) in
                        KINDS.items()], fontsize=7, loc="outside lower center", ncol=4)
    ax.set_title(title or "one FSDP2 step, unit by unit (measured)", fontsize=9)
    return fig


def options_bars(results: dict, baseline: str = "default"):
    """Three panels, one bar per option as a multiple of `baseline`'s: unsharded-parameter bytes
    at the peak (measured, with the prediction marked), bytes the collectives carried (payload
    S), and step time."""
    if not isinstance(results, dict) or baseline not in results:
        raise ValueError(f"results: allowed: the options part's 'results' dict, with the "
                         f"{baseline!r} option in it (got {type(results).__name__})")
    base = results[baseline]
    names = list(results)

    def total(r):
        return sum(c["bytes"] for c in r["collectives"].values())

    panels = (("peak unsharded parameters", lambda r: r["peak"] / base["peak"],
               lambda r: r["predicted_peak"] / base["peak"]),
              ("bytes sent (S)", lambda r: total(r) / total(base),
               lambda r: sum(c["bytes"] for c in r["predicted_collectives"].values())
               / total(base)),
              ("step time", lambda r: r["step_s"] / base["step_s"], None))
    fig = new_figure(9.0, 1.1 + 0.3 * len(names))
    axes = fig.subplots(1, len(panels), sharey=True)
    for ax, (label, measured, predicted) in zip(axes, panels):
        ys = range(len(names))
        ax.barh(list(ys), [measured(results[n]) for n in names], color="#4c72b0")
        if predicted is not None:
            ax.scatter([predicted(results[n]) for n in names], list(ys), marker="|", s=200,
                       color="black", zorder=3, label="predicted" if ax is axes[0] else None)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{label} (x {baseline})", fontsize=9)
    fig.legend(fontsize=7, loc="outside lower center")
    axes[0].set_yticks(list(range(len(names))))
    axes[0].set_yticklabels(names, fontsize=8)
    axes[0].invert_yaxis()
    return fig
