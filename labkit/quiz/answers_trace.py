"""Answers of the trace questions (labkit/quiz/data/trace.yaml, module 11): read from the
profiler traces the course ships (labkit/data/traces) with labkit.trace and labkit.trace_drills,
or checked on small event lists built here (what a GPU trace classifies as communication, which
rank a collective's waits point at), and labkit.scaling for DDP's buckets. Each trace question
is asked at the trace's last ProfilerStep (these traces hold one)."""
from __future__ import annotations

from pathlib import Path

from labkit import trace, trace_drills
from labkit.scaling import ddp_step_time

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def _ddp(variant: str, rank: int) -> tuple[str, int]:
    path = str(TRACES / f"ddp-{variant}-rank{rank}.json")
    return path, trace.steps(path)[-1]


def _ms(seconds: float) -> float:
    return seconds * 1e3


def exposed_all_reduce_ms(variant, rank):
    """Milliseconds of all-reduce work (gloo:all_reduce) with no compute running in the step."""
    path, step = _ddp(variant, rank)
    found = trace_drills.collectives(path, step=step)["all_reduce"]
    s = trace.summarize(path, step=step)
    return {"answer": _ms(found.exposed_s), "work_ms": _ms(found.seconds), "step": step,
            "hidden_ms": _ms(found.seconds - found.exposed_s), "span_ms": _ms(s.span_s),
            "compute_ms": _ms(s.compute_s), "events": found.count}


def all_reduces_issued(variant, rank):
    """All-reduces the rank issued in the step: its c10d::allreduce_ events."""
    path, step = _ddp(variant, rank)
    n = trace_drills.issued(path, "c10d::allreduce_")
    return {"answer": n, "step": step, "work_events": trace_drills.collectives(
        path, step=step)["all_reduce"].count}


def straggler_wait_ms(rank):
    """Milliseconds rank `rank` of the straggler run spent inside its collectives' work."""
    paths = [str(TRACES / f"ddp-straggler-rank{r}.json") for r in (0, 1)]
    s = trace_drills.straggler(paths, step=trace.steps(paths[0])[-1])
    return {"answer": _ms(s.wait_s[rank]), "slow": s.rank, "other": 1 - s.rank,
            "slow_ms": _ms(s.wait_s[s.rank]), "other_ms": _ms(s.wait_s[1 - s.rank])}


def hidden_share_pct(variant, rank):
    """Percent of the step's communication time during which compute ran."""
    path, step = _ddp(variant, rank)
    s = trace.summarize(path, step=step)
    return {"answer": 100 * trace_drills.overlap(path, step=step), "comm_ms": _ms(s.comm_s),
            "exposed_ms": _ms(s.exposed_comm_s), "hidden_ms": _ms(s.comm_s - s.exposed_comm_s)}


def verify_exposed_definition(variant, rank):
    """Exposed = communication minus its overlap with compute, on a shipped trace."""
    path, step = _ddp(variant, rank)
    lanes = trace.intervals(path, step=step)
    s = trace.summarize(path, step=step)
    comm, compute = trace.length(lanes.comm), trace.length(lanes.compute)
    overlap = trace.covered(lanes.comm, lanes.compute)
    holds = abs(s.exposed_comm_s * 1e6 - (comm - overlap)) < 1e-6 * max(comm, 1.0) and overlap < compute
    return {"holds": bool(holds), "comm_ms": comm / 1e3, "overlap_ms": overlap / 1e3,
            "exposed_ms": s.exposed_comm_s * 1e3, "compute_ms": compute / 1e3,
            "span_ms": s.span_s * 1e3, "naive_ms": max(0.0, comm - compute) / 1e3}


def verify_enqueue_vs_work(variant, rank):
    """On gloo, the all-reduce's time is its gloo:all_reduce work, not the c10d enqueue."""
    path, step = _ddp(variant, rank)
    _, _, _, lo, hi, found = trace.classified(path, step=step)
    enqueue = [(a, b) for e, k, a, b, _ in found if e["name"] == "c10d::allreduce_"]
    work = [(a, b) for e, k, a, b, _ in found if e["name"] == "gloo:all_reduce"]
    enq, wrk = trace.length(enqueue), trace.length(work)
    return {"holds": wrk > enq, "enqueue_ms": enq / 1e3, "work_ms": wrk / 1e3,
            "calls": len(enqueue)}


def _event(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def verify_nccl_kernels(dur_us):
    """In a GPU trace only the NCCL kernels are communication: the CPU-side ops launch them."""
    events = [_event("ProfilerStep#1", 0, 1000, "user_annotation"),
              _event("c10d::allreduce_", 10, 5), _event("record_param_comms", 11, 3),
              _event("cudaLaunchKernel", 12, 2, "cuda_runtime"),
              _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, dur_us, "kernel", 7),
              _event("sm90_xmma_gemm_bf16", 0, 15, "kernel", 8)]
    s = trace.summarize(events, step=1)
    holds = (trace.is_comm(events[4], gpu=True) and not trace.is_comm(events[1], gpu=True)
             and abs(s.comm_s * 1e6 - dur_us) < 1e-6)
    return {"holds": bool(holds), "comm_us": s.comm_s * 1e6, "exposed_us": s.exposed_comm_s * 1e6}


def verify_one_bucket(model, gpus, link):
    """One bucket: its all-reduce starts when the backward ends, so none of it is hidden."""
    one = ddp_step_time(model, gpus, link, compute_seconds=1.0, bucket_size_mb=1e9)
    small = ddp_step_time(model, gpus, link, compute_seconds=1.0, bucket_size_mb=25)
    holds = one.buckets == 1 and abs(one.exposed - one.communication) < 1e-9 * one.communication \
        and small.exposed < small.communication
    return {"holds": bool(holds), "one_ms": one.exposed * 1e3, "comm_ms": one.communication * 1e3,
            "small_exposed_ms": small.exposed * 1e3, "small_comm_ms": small.communication * 1e3,
            "buckets": small.buckets}


def verify_straggler_least_wait(slow_extra_ms, work_ms):
    """Two ranks, one all-reduce: the rank that arrives late spends the least time in it."""
    def rank(arrive, end):
        return [_event("ProfilerStep#1", 0, 1e6, "user_annotation"),
                _event("aten::mm", 0, arrive), _event("gloo:all_reduce", arrive, end - arrive,
                                                       "user_annotation", 2)]
    arrive_fast, arrive_slow = 10e3, 10e3 + slow_extra_ms * 1e3
    end = arrive_slow + work_ms * 1e3
    s = trace_drills.straggler([rank(arrive_fast, end), rank(arrive_slow, end)], step=1)
    return {"holds": s.rank == 1, "fast_in_ms": s.wait_s[0] * 1e3, "slow_in_ms": s.wait_s[1] * 1e3}
