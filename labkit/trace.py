"""Where a rank's time went, from its profiler trace: compute, communication, exposed
communication (not hidden under compute) and idle time. Pure Python over the Chrome-trace JSON
that `torch.profiler.profile(...).export_chrome_trace(path)` writes; never imports torch.

    from labkit import trace
    print(trace.summarize("rank0.json").text())            # the whole trace
    trace.summarize(events, step=3).exposed_comm_s          # one ProfilerStep#3 window

Which events count as communication and which as compute (gloo on CPU, NCCL on GPU): the rule
table above `is_comm`. Every total is a length of an interval union, so nested or overlapping
events (an op and its sub-ops, two gloo threads) are counted once.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

Interval = tuple[float, float]


# ---------------------------------------------------------------------------------------------
# interval unions (times in microseconds, as in the trace)

def union(intervals) -> list[Interval]:
    """The sorted, disjoint intervals covering the same time as `intervals`; empty ones
    (end <= start) dropped, overlapping and touching ones merged."""
    merged: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    """Time covered by `intervals`, overlaps counted once."""
    return sum(b - a for a, b in union(intervals))


def covered(a, b) -> float:
    """Time covered by both `a` and `b` (each any list of intervals): |union(a) ∩ union(b)|."""
    ua, ub, i, j, total = union(a), union(b), 0, 0, 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------------------------------
# classification
#
# A trace with any cat "kernel" event is a GPU trace, else a CPU trace.
#
#   CPU (gloo) communication: names gloo:* (the work, on gloo's own threads: pt_gloo_runloop and
#       a worker), c10d::* (the caller's enqueue, e.g. c10d::allreduce_), nccl:*,
#       record_param_comms.
#   CPU compute: cat "cpu_op" named aten::*, unless inside a communication event on the same
#       thread (a collective's own copies are communication), gloo:send and gloo:recv excepted:
#       on the caller's thread they span from an isend/irecv's post to its completion, while the
#       caller goes on computing; and labkit::compute* ranges
#       (the pipeline labs' SleepLayer sleeps in place of a stage's matmuls, under that name).
#   GPU (NCCL) communication: cat "kernel" named nccl* (ncclDevKernel_AllReduce_Sum_f32_RING_LL,
#       older ncclKernel_...). The CPU-side c10d::*, nccl:*, record_param_comms only launch them.
#   GPU compute: every other cat "kernel" event. Memcpy/memset (cat gpu_memcpy, gpu_memset) and
#       all CPU ops are neither.
#
# The profiler's own "Trace" span and Python/user annotations (ProfilerStep#N, Optimizer.step#...,
# DistributedDataParallel.forward) are neither: they wrap both kinds of work.

COMM_NAME = re.compile(r"^(gloo:|c10d::|nccl|record_param_comms)", re.IGNORECASE)


def is_comm(event: dict, *, gpu: bool = False) -> bool:
    """Communication by the table above; in a GPU trace only NCCL kernels count."""
    if not COMM_NAME.match(str(event.get("name", ""))):
        return False
    return event.get("cat") == "kernel" if gpu else True


def is_compute(event: dict, *, gpu: bool = False) -> bool:
    """Compute by the table above (not checking nesting inside communication: summarize does)."""
    name = str(event.get("name", ""))
    if gpu:
        return event.get("cat") == "kernel" and not COMM_NAME.match(name)
    return (event.get("cat") == "cpu_op" and name.startswith("aten::")) or name.startswith("labkit::compute")


# ---------------------------------------------------------------------------------------------
# loading

ALLOWED = ("a path to a Chrome-trace JSON file (torch.profiler's export_chrome_trace), "
           "the loaded dict with a 'traceEvents' list, or a list of its events")


def _read(trace) -> tuple[list[dict], int | None]:
    rank = None
    if isinstance(trace, (str, Path)):
        path = Path(trace)
        try:
            trace = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable JSON trace ({err}); expected {ALLOWED}") from None
    if isinstance(trace, dict):
        if not isinstance(trace.get("traceEvents"), list):
            raise ValueError(f"a trace dict needs a 'traceEvents' list, got keys {sorted(trace)[:8]}; "
                             f"expected {ALLOWED}")
        info = trace.get("distributedInfo") or {}
        rank = info.get("rank") if isinstance(info, dict) else None
        trace = trace["traceEvents"]
    if not isinstance(trace, list):
        raise ValueError(f"cannot read a trace from a {type(trace).__name__}; expected {ALLOWED}")
    events = []
    for i, e in enumerate(trace):
        if not isinstance(e, dict):
            raise ValueError(f"event {i} is a {type(e).__name__}, not a dict; expected {ALLOWED}")
        if e.get("ph", "X") != "X":
            continue            # metadata (M), flows (s, f), instants (i): no duration
        ts, dur = e.get("ts"), e.get("dur")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (ts, dur)) or dur < 0:
            raise ValueError(f"complete event {i} ({e.get('name', '?')!r}) needs numeric 'ts' and "
                             f"'dur' >= 0 in microseconds, got ts={ts!r}, dur={dur!r}")
        events.append({**e, "ph": "X"})
    if not events:
        raise ValueError(f"the trace has no complete ('X') events with 'ts' and 'dur'; expected {ALLOWED}")
    return events, rank


def load(trace) -> list[dict]:
    """The complete ("X") events of a trace given as a path, a loaded dict or a list of events;
    ValueError saying what is wrong otherwise. Other phases (metadata, flows) are dropped."""
    return _read(trace)[0]


# ---------------------------------------------------------------------------------------------
# the summary

@dataclass
class TraceSummary:
    rank: int | None
    gpu: bool                   # classified as a GPU (NCCL) trace: it has "kernel" events
    span_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float       # communication time with no compute running
    idle_s: float               # span with neither compute nor communication
    top_ops: list[tuple[str, float, int]] = field(default_factory=list)  # (name, self s, count)
    step: int | None = None

    def text(self) -> str:
        who = "rank ?" if self.rank is None else f"rank {self.rank}"
        where = f"ProfilerStep#{self.step}" if self.step is not None else "whole trace"
        ms = lambda s: f"{s * 1e3:9.3f} ms"  # noqa: E731
        lines = [f"{who}, {where} ({'GPU kernels' if self.gpu else 'CPU ops'}): span {ms(self.span_s)}",
                 f"  compute       {ms(self.compute_s)}", f"  communication {ms(self.comm_s)}",
                 f"    exposed     {ms(self.exposed_comm_s)}", f"  idle          {ms(self.idle_s)}",
                 "  top ops (self time, count):"]
        lines += [f"    {ms(s)}  x{n:<4d} {name}" for name, s, n in self.top_ops]
        return "\n".join(lines)


# gloo's point-to-point work is a span on the caller's own thread from the post (isend, irecv)
# to the completion: open while the caller computes on, so it is nobody's parent (a leaf).
ASYNC_SPAN = re.compile(r"^gloo:(send|recv)$")


def _walk(events: list[dict], gpu: bool):
    """(event, self time in us, inside a communication event?) per event, nesting taken per
    (pid, tid): a child starts and ends within its parent, as the profiler writes them (but for
    the ASYNC_SPAN leaves, which may outlive the op that posted them)."""
    threads: dict = {}
    for e in events:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []          # [event, child time, inside comm]
        out = []
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                out.append(stack.pop())
            inside = bool(stack) and (stack[-1][2] or is_comm(stack[-1][0], gpu=gpu))
            if stack:
                parent = stack[-1][0]
                stack[-1][1] += min(e["ts"] + e["dur"], parent["ts"] + parent["dur"]) - e["ts"]
            if ASYNC_SPAN.match(str(e.get("name", ""))):
                out.append([e, 0.0, inside])
            else:
                stack.append([e, 0.0, inside])
        out += stack
        for e, child, inside in out:
            yield e, max(0.0, e["dur"] - child), inside


def steps(trace) -> list[int]:
    """The N of each ProfilerStep#N window in the trace."""
    return sorted(int(m.group(1)) for e in load(trace)
                  if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", "")))))


@dataclass
class Lanes:
    """One rank's classified time within a window (microseconds, as in the trace): the
    disjoint, sorted intervals of compute, of communication and of exposed communication
    (communication with no compute running), and the window [lo, hi)."""
    rank: int | None
    gpu: bool
    lo: float
    hi: float
    compute: list[Interval]
    comm: list[Interval]
    exposed: list[Interval]
    step: int | None = None


def subtract(a, b) -> list[Interval]:
    """The time in `a` not in `b` (each any list of intervals), as disjoint sorted intervals."""
    out, ub, j = [], union(b), 0
    for lo, hi in union(a):
        while j < len(ub) and ub[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(ub) and ub[k][0] < hi:
            if ub[k][0] > cur:
                out.append((cur, ub[k][0]))
            cur = max(cur, ub[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def window(events: list[dict], step: int | None) -> tuple[float, float]:
    """[lo, hi) in microseconds of ProfilerStep#`step` (the whole trace for None)."""
    if step is None:
        return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)
    found = [e for e in events if e.get("name") == f"ProfilerStep#{step}"]
    if not found:
        raise ValueError(f"no ProfilerStep#{step} in the trace; its steps: {steps(events) or 'none'}")
    return found[0]["ts"], found[0]["ts"] + found[0]["dur"]


def classified(trace, *, step: int | None = None):
    """(events without the profiler's own span, rank, gpu, lo, hi, [(event, kind, a, b, self
    us)]) for every communication ("comm") and compute ("compute") event clipped to the window."""
    events, rank = _read(trace)
    events = [e for e in events if e.get("cat") != "Trace"]     # the profiler's own span
    lo, hi = window(events, step)
    gpu = any(e.get("cat") == "kernel" for e in events)
    out = []
    for e, self_us, inside_comm in _walk(events, gpu):
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if b <= a and not (e["dur"] == 0 and lo <= e["ts"] <= hi):
            continue                    # outside the window
        if is_comm(e, gpu=gpu):
            out.append((e, "comm", a, b, self_us))
        elif is_compute(e, gpu=gpu) and not inside_comm:
            out.append((e, "compute", a, b, self_us))
    return events, rank, gpu, lo, hi, out


def intervals(trace, *, step: int | None = None) -> Lanes:
    """The compute, communication and exposed-communication intervals of one rank's trace (a
    path, a loaded dict or a list of events), whole or within ProfilerStep#`step`: what a
    timeline draws and what `summarize` measures."""
    _, rank, gpu, lo, hi, found = classified(trace, step=step)
    compute = union((a, b) for _, kind, a, b, _ in found if kind == "compute")
    comm = union((a, b) for _, kind, a, b, _ in found if kind == "comm")
    return Lanes(rank, gpu, lo, hi, compute, comm, subtract(comm, compute), step)


def summarize(trace, *, step: int | None = None, top: int = 10) -> TraceSummary:
    """Compute, communication, exposed communication and idle time of one rank's trace (a path,
    a loaded dict or a list of events), whole or within the ProfilerStep#`step` window."""
    _, rank, gpu, lo, hi, found = classified(trace, step=step)
    compute = [(a, b) for _, kind, a, b, _ in found if kind == "compute"]
    comm = [(a, b) for _, kind, a, b, _ in found if kind == "comm"]
    ops: dict = {}
    for e, _, _, _, self_us in found:
        s, n = ops.get(e["name"], (0.0, 0))
        ops[e["name"]] = (s + self_us, n + 1)
    comm_us = length(comm)
    exposed_us = comm_us - covered(comm, compute)
    idle_us = (hi - lo) - length(comm + compute)
    top_ops = sorted(((name, s / 1e6, n) for name, (s, n) in ops.items()), key=lambda t: (-t[1], t[0]))
    return TraceSummary(rank=rank, gpu=gpu, span_s=(hi - lo) / 1e6, compute_s=length(compute) / 1e6,
                        comm_s=comm_us / 1e6, exposed_comm_s=exposed_us / 1e6, idle_s=idle_us / 1e6,
                        top_ops=top_ops[:top], step=step)
