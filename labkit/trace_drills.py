"""The questions a person asks of a slow run's traces, answered from the traces themselves:
which collectives ran and how much of each was exposed, whether the overlap a flag promised
happened, which rank straggles, where a pipeline's bubble is. Pure Python over labkit.trace.

    from labkit import trace_drills as drills
    drills.collectives("rank0.json", step=3)        # {"all_reduce": Collective(n, s, exposed s)}
    drills.overlap("rank0.json", step=3)            # share of communication hidden under compute
    drills.backward_lead("rank0.json", step=3)      # > 0: a collective began during the backward
    drills.straggler(["rank0.json", "rank1.json"])  # the rank the others wait for, and why
    drills.bubble("pp-1f1b-rank3.json", step=3)     # a pipeline rank's time without compute
(`straggler` decides by wait times, which need no clock common to the ranks)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from labkit.trace import classified, covered, intervals, length, load, steps, subtract, union

# Normalised collective names: the work event's name (gloo:all_reduce, ncclDevKernel_AllReduce_
# Sum_f32_RING_LL, c10d::allreduce_, nccl:all_reduce) -> all_reduce, all_gather, reduce_scatter,
# all_to_all, broadcast, reduce, send, recv, send_recv, barrier.
_KINDS = (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
          ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"),
          ("barrier", "barrier"), ("reduce", "reduce"), ("send", "send"), ("recv", "recv"))


def kind(name: str) -> str:
    """The collective a communication event runs, normalised ("all_reduce", ...), or the name
    itself when it is none of the known ones."""
    text = re.sub(r"^(gloo:|c10d::|nccl:|ncclDevKernel_|ncclKernel_)", "", str(name), flags=re.I)
    flat = text.lower().replace("_", "")
    for key, out in _KINDS:
        if flat.startswith(key):
            return out
    return text


def _is_work(event: dict, gpu: bool) -> bool:
    """The event that spans a collective's work: gloo:* on CPU (on gloo's threads, or the
    caller's for send/recv), an nccl kernel on GPU. The c10d::* caller ops only enqueue it."""
    name = str(event.get("name", ""))
    return name.lower().startswith("nccl") if gpu else name.startswith("gloo:")


@dataclass(frozen=True)
class Collective:
    count: int
    seconds: float          # union of its events' intervals
    exposed_s: float        # of which no compute ran


def collectives(trace, *, step: int | None = None) -> dict[str, Collective]:
    """Per collective kind in the window: how many ran, their time and their exposed time."""
    _, _, gpu, lo, hi, found = classified(trace, step=step)
    compute = [(a, b) for _, k, a, b, _ in found if k == "compute"]
    spans: dict[str, list] = {}
    counts: dict[str, int] = {}
    for e, k, a, b, _ in found:
        if k == "comm" and _is_work(e, gpu):
            name = kind(e["name"])
            spans.setdefault(name, []).append((a, b))
            # counted in the window it starts in: a collective's work event may end a few
            # microseconds after the step that waited for it (its thread closes the range later)
            counts[name] = counts.get(name, 0) + (lo <= e["ts"] < hi)
    return {name: Collective(counts[name], length(iv) / 1e6, length(subtract(iv, compute)) / 1e6)
            for name, iv in sorted(spans.items())}


def exposed_per_step(trace) -> dict[int, float]:
    """Seconds of exposed communication in each ProfilerStep window."""
    return {n: length(intervals(trace, step=n).exposed) / 1e6 for n in steps(trace)}


def most_exposed(trace, *, step: int | None = None) -> str:
    """The collective kind with the most exposed time in the window."""
    found = collectives(trace, step=step)
    if not found:
        raise ValueError("the window has no communication; nothing is exposed")
    return max(found, key=lambda k: (found[k].exposed_s, k))


def overlap(trace, *, step: int | None = None) -> float:
    """The share (0..1) of communication time that ran while compute ran: 0 means every
    collective waited alone (nothing overlapped), 1 means all of it was hidden."""
    lanes = intervals(trace, step=step)
    total = length(lanes.comm)
    if total == 0:
        raise ValueError("the window has no communication; there is no overlap to measure")
    return covered(lanes.comm, lanes.compute) / total


BACKWARD = "autograd::engine::evaluate_function: "     # one backward node's span (CPU traces)


def backward_lead(trace, *, step: int | None = None) -> float:
    """Seconds by which the window's first collective started before its backward ended (the
    end of its last autograd node that computes, AccumulateGrad left out: DDP's hooks run
    inside those and launch the all-reduces): > 0, it was issued while gradients were still
    being computed, so it could overlap them; <= 0, it could not (it waited for the whole
    backward: DDP with a single bucket). ValueError without a backward or a collective."""
    events = [e for e in load(trace) if e.get("cat") != "Trace"]
    _, _, gpu, lo, hi, found = classified(events, step=step)
    ends = [e["ts"] + e["dur"] for e in events
            if str(e.get("name", "")).startswith(BACKWARD) and "AccumulateGrad" not in e["name"]
            and lo <= e["ts"] < hi]
    starts = [e["ts"] for e, k, _, _, _ in found if k == "comm" and _is_work(e, gpu) and lo <= e["ts"] < hi]
    if not ends:
        raise ValueError("the window has no autograd node (no backward); allowed: a CPU trace "
                         "of a training step")
    if not starts:
        raise ValueError("the window has no collective; nothing could overlap the backward")
    return (max(ends) - min(starts)) / 1e6


@dataclass(frozen=True)
class Straggler:
    rank: int                       # the rank the others wait for
    wait_s: dict[int, float]        # per rank: time inside collectives (waiting included)
    late_s: dict[int, float]        # per rank: summed lateness of its arrivals at collectives

    def text(self) -> str:
        rows = [f"rank {r}: in collectives {self.wait_s[r] * 1e3:8.2f} ms, arrived late by "
                f"{self.late_s[r] * 1e3:8.2f} ms in all" for r in sorted(self.wait_s)]
        return "\n".join([f"straggler: rank {self.rank} (the others wait for it)", *rows])


def straggler(traces, *, step: int | None = None) -> Straggler:
    """Which of the ranks' traces (a list, in rank order) the others wait for: the one with the
    least time inside collectives, since a collective ends for everyone when its last rank
    arrives. `late_s` adds each rank's arrival lateness per collective (the n-th work event of
    each rank, matched in order), which agrees on one machine."""
    if len(traces) < 2:
        raise ValueError(f"a straggler needs 2 or more ranks' traces, got {len(traces)}")
    wait, starts = {}, {}
    for r, t in enumerate(traces):
        _, _, gpu, lo, hi, found = classified(t, step=step)
        work = sorted((a, b) for e, k, a, b, _ in found if k == "comm" and _is_work(e, gpu))
        wait[r] = length(work) / 1e6
        starts[r] = sorted(e["ts"] for e, k, _, _, _ in found
                           if k == "comm" and _is_work(e, gpu) and lo <= e["ts"] < hi)
    n = min(len(s) for s in starts.values())
    if n == 0:
        raise ValueError("some rank's window has no collective; nothing to wait for")
    late = {r: 0.0 for r in starts}
    for i in range(n):
        first = min(starts[r][i] for r in starts)
        for r in starts:
            late[r] += (starts[r][i] - first) / 1e6
    return Straggler(min(wait, key=lambda r: (wait[r], r)), wait, late)


@dataclass(frozen=True)
class Bubble:
    span_s: float
    no_compute_s: float             # the bubble: the window's time with no compute
    before_s: float                 # of which before the first compute (warm-up)
    after_s: float                  # of which after the last compute (drain)
    gaps: list                      # (start s, length s) of each gap inside, from the window's start

    @property
    def share(self) -> float:
        return self.no_compute_s / self.span_s if self.span_s else 0.0


def bubble(trace, *, step: int | None = None, min_gap_s: float = 0.0) -> Bubble:
    """A pipeline rank's time without compute in the window (waiting in a recv counts: it is
    bubble, not work), split into before its first compute, after its last, and the gaps
    between (those longer than `min_gap_s`)."""
    lanes = intervals(trace, step=step)
    span = lanes.hi - lanes.lo
    comp = union(lanes.compute)
    if not comp:
        return Bubble(span / 1e6, span / 1e6, span / 1e6, 0.0, [])
    holes = subtract([(lanes.lo, lanes.hi)], comp)
    before = comp[0][0] - lanes.lo
    after = lanes.hi - comp[-1][1]
    gaps = [((a - lanes.lo) / 1e6, (b - a) / 1e6) for a, b in holes
            if a > lanes.lo and b < lanes.hi and (b - a) / 1e6 > min_gap_s]
    return Bubble(span / 1e6, (span - length(comp)) / 1e6, before / 1e6, after / 1e6, gaps)


def issued(trace, name: str) -> int:
    """How many events named `name` the trace holds (e.g. "c10d::allreduce_": all-reduces the
    rank issued), to check a trace against what the program says it did."""
    return sum(1 for e in load(trace) if e.get("name") == name)
