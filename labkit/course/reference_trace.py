"""Reference answers of module 11's exercises (reading profiler traces), computed at run time.

The check cells of solutions/11_reading_a_run.ipynb call these as labkit.course.reference.NAME
(reference re-exports them; a workshop handout leaves this file out); labkit.trace and
labkit.trace_drills compute them, on the traces shipped in labkit/data/traces (`TRACES`).
MISTAKES holds the usual wrong answers (labkit.course.reference merges it into its own, so the
grader names them); a label names the idea missed, never the answer. Every exercise forbids this
module (its metadata labkit.forbid).
"""
from __future__ import annotations

from pathlib import Path

from labkit import trace, trace_drills

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def trace_path(name: str) -> str:
    """The path (text: the grader records cases as plain values) of a shipped trace."""
    return str(TRACES / name)


# ----------------------------------------------------------------------- exercise 1: exposed

def exposed(compute, comm) -> float:
    """Time of `comm` not covered by `compute` (each a list of (start, end)), overlaps once."""
    return trace.length(trace.subtract(comm, compute))


def _overlap(a, b) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _no_union(compute, comm) -> float:
    return sum(b - a for a, b in comm if b > a) - sum(
        _overlap(c, k) for c in comm if c[1] > c[0] for k in compute if k[1] > k[0])


def _compute_not_merged(compute, comm) -> float:
    return trace.length(comm) - sum(trace.covered(comm, [k]) for k in compute if k[1] > k[0])


# ------------------------------------------------------------- exercises 2-4: shipped traces

def _lanes(path, step, work=("gloo:",), clip=True):
    """(compute, comm) intervals in us by the simple CPU rule: compute the aten cpu ops, comm
    the events whose name starts with one of `work`; clipped to ProfilerStep#step."""
    events = trace.load(path)
    lo, hi = trace.window(events, step)
    compute, comm = [], []
    for e in events:
        name, a, b = str(e.get("name", "")), e["ts"], e["ts"] + e["dur"]
        if clip:
            a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if e.get("cat") == "cpu_op" and name.startswith("aten::"):
            compute.append((a, b))
        elif name.startswith(work):
            comm.append((a, b))
    return compute, comm


def exposed_all_reduce_ms(path, step) -> float:
    """Milliseconds of all-reduce work (gloo:all_reduce) with no compute running, in the step."""
    found = trace_drills.collectives(path, step=step).get("all_reduce")
    return found.exposed_s * 1e3 if found else 0.0


def collective_seconds(path, step) -> float:
    """Seconds a rank spent inside its collectives' work in the step (waiting included)."""
    return trace_drills.straggler([path, path], step=step).wait_s[0]


def slow_rank(paths, step) -> int:
    return trace_drills.straggler(list(paths), step=step).rank


def waited_s(paths, step) -> float:
    """Seconds the rank that is not the straggler spent inside collectives (2 ranks)."""
    s = trace_drills.straggler(list(paths), step=step)
    return next(w for r, w in s.wait_s.items() if r != s.rank)


def hidden_share(path, step) -> float:
    return trace_drills.overlap(path, step=step)


def more_hidden(paths: dict, step) -> str:
    """The key of `paths` ({label: path}) whose trace hid the largest share of communication."""
    return max(paths, key=lambda k: (hidden_share(paths[k], step), k))


def overlapped(path, step) -> bool:
    """Whether any of the step's communication ran while compute ran."""
    return hidden_share(path, step) > 0


_ALL_REDUCE = ("gloo:all_reduce",)

# The usual wrong answers, (label, function of the check's case): labkit.course.reference
# merges them into its MISTAKES (tests/course/test_grading_hints.py checks the wording).
MISTAKES = {
    "exposed": (
        ("the hidden time, not the exposed: the question is the communication with no compute "
         "running", lambda compute, comm: trace.covered(comm, compute)),
        ("compute and communication swapped: the exposed time is part of the communication",
         lambda compute, comm: exposed(comm, compute)),
        ("compute intervals that overlap each other were subtracted twice: merge the compute "
         "intervals too before taking what they cover", _compute_not_merged),
        ("overlaps counted twice: intervals of one list that overlap each other (two threads, "
         "nested events) cover that time once; merge each list before measuring", _no_union)),
    "exposed_all_reduce_ms": (
        ("the enqueue, not the work: on gloo the caller's c10d op only hands the all-reduce "
         "to gloo's threads, where the work runs",
         lambda path, step: exposed(*_lanes(path, step, ("c10d::allreduce",))) / 1e3),
        ("the events were not clipped to the step: one that began in the step before counts "
         "only from the step's start",
         lambda path, step: exposed(*_lanes(path, step, _ALL_REDUCE, clip=False)) / 1e3),
        ("all of the all-reduce time: what compute covers is hidden, not exposed",
         lambda path, step: trace.length(_lanes(path, step, _ALL_REDUCE)[1]) / 1e3)),
    "collective_seconds": (
        ("durations added up: the events of two gloo threads overlap, and that time counts "
         "once", lambda path, step: sum(b - a for a, b in _lanes(path, step)[1]) / 1e6),
        ("the events were not clipped to the step: one that began in the step before counts "
         "only from the step's start",
         lambda path, step: trace.length(_lanes(path, step, clip=False)[1]) / 1e6),
        ("the enqueue, not the work: on gloo the caller's c10d op only hands the collective "
         "to gloo's threads", lambda path, step: trace.length(_lanes(path, step, ("c10d::",))[1])
         / 1e6)),
    "hidden_share": (
        ("the exposed share, not the hidden one", lambda path, step: 1 - hidden_share(path, step)),
        ("a share of the whole step, not of the communication time",
         lambda path, step: hidden_share(path, step) * trace.summarize(path, step=step).comm_s
         / trace.summarize(path, step=step).span_s),
        ("only gloo's work counted as communication: the table counts the caller's c10d ops "
         "too", lambda path, step: 1 - exposed(*_lanes(path, step)) / trace.length(
             _lanes(path, step)[1]))),
}
