"""The event simulation under `labkit.pipeline` and `labkit.pipeline_check`: per-rank orders of
passes in, a timeline of `Event`s out (start, end of each pass on its rank), with the step's
makespan and each rank's peak of micro-batch chunks in flight. Also the idle share of any
event list, simulated or measured.

    >>> r = run_orders("1f1b", [[(("F", 0, 0),), (("B", 0, 0),)]], {0: (0, 0)},
    ...                {"F": 1.0, "B": 2.0}, 0.0, 3.0)      # one rank, stage, micro-batch
    >>> r.makespan, idle_share(r.events)                     # 3.0, 0.0

Placement is general (any stage on any rank), so the same code runs labkit's schedules and a
schedule written by hand; `labkit.pipeline.simulate` documents the rules of time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit import validate


@dataclass(frozen=True)
class Event:
    stage: int          # the rank (a "stage" of p; with v chunks it holds v virtual stages)
    kind: str           # "F" forward, "B" backward (input grad if split), "W" weight grad
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class PipelineResult:
    schedule: str
    stages: int
    microbatches: int
    chunks: int
    events: list = field(default_factory=list)
    makespan: float = 0.0
    ideal: float = 0.0                 # one stage's busy time: m (f + b [+ w])
    peak_in_flight: list = field(default_factory=list)   # per stage, in micro-batches
    peak_chunks: list = field(default_factory=list)      # per stage, in micro-batch chunks

    @property
    def busy(self) -> list[float]:
        out = [0.0] * self.stages
        for e in self.events:
            out[e.stage] += e.end - e.start
        return out

    @property
    def span_idle(self) -> list[float]:
        """Each rank's idle time between its own first start and last end: the bubble as the
        zero-bubble and DualPipe papers count it (a rank that starts late is not idle then)."""
        out = []
        for i in range(self.stages):
            mine = [e for e in self.events if e.stage == i]
            out.append(max(e.end for e in mine) - min(e.start for e in mine)
                       - sum(e.end - e.start for e in mine) if mine else 0.0)
        return out

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step: idle time of all stages / (stages x makespan)."""
        return idle_share(self.events, self.stages)

    @property
    def bubble_ratio(self) -> float:
        """Bubble relative to the ideal time: (makespan - ideal) / ideal ((p-1)/m for 1F1B)."""
        return (self.makespan - self.ideal) / self.ideal


def run_orders(schedule, orders, place, cost, c, ideal, microbatches=None) -> PipelineResult:
    """Run per-rank orders and time every pass.

    orders[r]: rank r's steps in order; a step is a tuple of passes (kind, microbatch, virtual
    stage) run back to back (two for DualPipeV's overlapped forward-backward pair, one
    otherwise). kind: "F"; "B" (a backward that sends its input gradient on); "W"; "BW" (a full
    backward, B = I + W: drawn as its B part then its W part, its gradient sent at the end).
    place[s] = (rank, chunk) of virtual stage s (0 .. S - 1, the last computes the loss).
    cost[r][kind] (or cost[kind], the same on every rank): seconds of one pass; "BW" costs
    cost B + cost W. c: seconds to send between ranks (nothing between stages on one rank).

    A pass starts when its rank is free and its input is ready: an F needs the previous stage's
    F, a B the next stage's B (the last stage's own F), a W its own B. A step's outputs leave
    when the step ends (torch sends an overlapped pair's results after both passes; a pass
    waits for its own input only, _PipelineScheduleRuntime). The simulation takes a rank's
    steps in order, so a pair whose backward waits on its own forward's result deadlocks, as
    in torch.
    In flight: chunks forwarded and not yet through B (a W holds less and is left out, as the
    zero-bubble paper counts); peak_in_flight divides by the chunks the rank holds."""
    ranks = len(orders)
    last = len(place) - 1
    costs = [cost[r] if isinstance(cost, (list, tuple)) else cost for r in range(ranks)]
    held_by = [sum(1 for r, _ in place.values() if r == i) or 1 for i in range(ranks)]
    done: dict = {}                 # (kind, microbatch, virtual stage) -> time its output is out
    free, pos = [0.0] * ranks, [0] * ranks
    held, peak = [0] * ranks, [0] * ranks
    events = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(ranks):
            while pos[i] < len(orders[i]):
                ready = []                  # when each pass's input is there
                for kind, j, s in orders[i][pos[i]]:
                    if kind == "F":
                        dep = None if s == 0 else ("F", j, s - 1)
                    elif kind in ("B", "BW"):
                        dep = ("F", j, last) if s == last else ("B", j, s + 1)
                    else:
                        dep = ("B", j, s)
                    if dep is not None and dep not in done:
                        break
                    sent = dep is not None and place[dep[2]][0] != i
                    ready.append(0.0 if dep is None else done[dep] + (c if sent else 0.0))
                else:
                    t = free[i]
                    for (kind, j, s), at in zip(orders[i][pos[i]], ready):
                        t = max(t, at)
                        for part in ("B", "W") if kind == "BW" else (kind,):
                            end = t + costs[i][part]
                            events.append(Event(i, part, j, place[s][1], t, end))
                            t = end
                        held[i] += {"F": 1, "B": -1, "BW": -1}.get(kind, 0)
                        peak[i] = max(peak[i], held[i])
                    for kind, j, s in orders[i][pos[i]]:      # sent when the step ends
                        done[("B" if kind == "BW" else kind, j, s)] = t
                    free[i] = t
                    pos[i] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {i: orders[i][pos[i]] for i in range(ranks) if pos[i] < len(orders[i])}
            raise RuntimeError(f"schedule {schedule!r} deadlocked: next steps {stuck}")
    events.sort(key=lambda e: (e.start, e.stage))
    chunks = max(ch for _, ch in place.values()) + 1
    m = microbatches if microbatches is not None else 1 + max(e.microbatch for e in events)
    return PipelineResult(schedule, ranks, m, chunks, events, max(free), ideal,
                          [k / n for k, n in zip(peak, held_by)], peak)


def as_events(events) -> list[Event]:
    """`Event`s from a PipelineResult, Events, or dicts with stage, kind, microbatch, start,
    end (and chunk, default 0): what a measured run reports (labkit.parallel.pipe)."""
    if isinstance(events, PipelineResult):
        return list(events.events)
    out = []
    for e in events:
        if isinstance(e, Event):
            out.append(e)
            continue
        try:
            out.append(Event(int(e["stage"]), str(e["kind"]), int(e["microbatch"]),
                             int(e.get("chunk", 0)), float(e["start"]), float(e["end"])))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ValueError(f"event {validate.describe(e)} is not an Event or a dict with "
                             "stage, kind, microbatch, start, end (chunk optional)") from None
    if not out:
        raise ValueError("events=[] has no event; allowed: Events or dicts with stage, kind, "
                         "microbatch, start, end")
    return out


def idle_share(events, stages=None) -> float:
    """Idle share of a step from its events (`as_events`: a measured run's dicts too):
    1 - busy time of all stages / (stages x (last end - first start)). stages: how many ran
    (default: those with an event)."""
    rows = as_events(events)
    n = len({e.stage for e in rows}) if stages is None else validate.positive_int(
        "stages", stages)
    span = max(e.end for e in rows) - min(e.start for e in rows)
    if span <= 0:
        raise ValueError(f"events span {span} s; allowed: events whose last end is after "
                         "their first start")
    return 1 - sum(e.end - e.start for e in rows) / (n * span)
