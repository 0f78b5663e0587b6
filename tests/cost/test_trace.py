"""labkit.trace: interval unions, classification, and summaries of crafted traces (answers known
by construction), of a synthetic NCCL-style GPU trace and of real gloo traces recorded by
tools/record_trace_fixture.py (tests/fixtures/traces/)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import trace
from labkit.trace import covered, is_comm, is_compute, length, summarize, union

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MS = 1000.0     # trace times are microseconds


def x(name, ts_ms, end_ms, cat="cpu_op", tid=1, pid=1):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
            "ts": ts_ms * MS, "dur": (end_ms - ts_ms) * MS}


# ---------------------------------------------------------------------------------------------
# interval unions

@pytest.mark.parametrize("given, expected", [
    ([], []),
    ([(0, 0), (5, 3)], []),                                # empty and reversed: dropped
    ([(0, 2), (1, 3)], [(0, 3)]),                          # overlap
    ([(0, 10), (2, 4), (5, 6)], [(0, 10)]),                # nesting
    ([(0, 1), (1, 2)], [(0, 2)]),                          # touching
    ([(5, 6), (0, 1), (2, 3)], [(0, 1), (2, 3), (5, 6)]),  # unsorted, disjoint
])
def test_union_is_exact(given, expected):
    assert union(given) == expected


@pytest.mark.parametrize("a, b, both", [
    ([(0, 10)], [(5, 15)], 5),
    ([(0, 10), (20, 30)], [(5, 25)], 10),
    ([(0, 10)], [(2, 3), (2, 4), (6, 7)], 3),       # b overlapping itself: counted once
    ([(0, 1)], [(1, 2)], 0),                        # touching: nothing shared
    ([], [(0, 5)], 0),
    ([(0, 4), (4, 8)], [(3, 5)], 2),
])
def test_covered_is_exact_and_symmetric(a, b, both):
    assert covered(a, b) == pytest.approx(both) and covered(b, a) == pytest.approx(both)


def test_length_counts_overlaps_once():
    assert length([(0, 10), (5, 15), (20, 21)]) == 16


# ---------------------------------------------------------------------------------------------
# crafted traces

def test_exposed_communication_known_by_construction():
    # compute 0-10 and 20-30 ms, communication 5-25 ms on gloo's thread: 10 ms of it exposed
    events = [x("aten::mm", 0, 10), x("aten::mm", 20, 30), x("gloo:all_reduce", 5, 25, "user_annotation", tid=2)]
    s = summarize(events)
    assert (s.span_s, s.compute_s, s.comm_s, s.exposed_comm_s, s.idle_s) == pytest.approx((0.030, 0.020, 0.020, 0.010, 0))


def test_idle_is_the_span_with_neither():
    events = [x("aten::mm", 0, 10), x("gloo:all_reduce", 15, 20, "user_annotation", tid=2),
              x("ProfilerStep#1", 0, 40, "user_annotation")]
    s = summarize(events)
    assert (s.span_s, s.idle_s, s.exposed_comm_s) == pytest.approx((0.040, 0.025, 0.005))


def test_nested_events_are_not_counted_twice():
    events = [x("aten::linear", 0, 10), x("aten::addmm", 2, 8), x("aten::copy_", 3, 4),
              x("gloo:all_reduce", 1, 3, "user_annotation", tid=2), x("gloo:all_reduce", 2, 4, "user_annotation", tid=3)]
    s = summarize(events)
    assert (s.compute_s, s.comm_s, s.exposed_comm_s) == pytest.approx((0.010, 0.003, 0))
    ops = {name: (sec, n) for name, sec, n in s.top_ops}
    assert ops["aten::linear"] == pytest.approx((0.004, 1))        # self time: 10 - 6
    assert ops["aten::addmm"] == pytest.approx((0.005, 1))         # 6 - 1
    assert ops["gloo:all_reduce"] == pytest.approx((0.004, 2))


def test_a_collectives_own_ops_are_communication_not_compute():
    events = [x("c10d::allreduce_", 0, 10), x("aten::copy_", 2, 4), x("aten::mm", 10, 12)]
    s = summarize(events)
    assert (s.compute_s, s.comm_s, s.exposed_comm_s) == pytest.approx((0.002, 0.010, 0.010))


def test_step_window_clips_to_profiler_step():
    events = [x("ProfilerStep#4", 0, 10, "user_annotation"), x("ProfilerStep#5", 10, 20, "user_annotation"),
              x("aten::mm", 2, 12), x("gloo:all_reduce", 15, 30, "user_annotation", tid=2)]
    s4, s5 = summarize(events, step=4), summarize(events, step=5)
    assert (s4.span_s, s4.compute_s, s4.comm_s) == pytest.approx((0.010, 0.008, 0))
    assert (s5.span_s, s5.compute_s, s5.comm_s, s5.idle_s) == pytest.approx((0.010, 0.002, 0.005, 0.003))
    assert trace.steps(events) == [4, 5]


# ---------------------------------------------------------------------------------------------
# a GPU trace in the shape Kineto writes with NCCL: kernels on streams (tid), cat "kernel"

def gpu_trace():
    cpu = [x("aten::mm", 0, 0.05), x("record_param_comms", 0.1, 0.2), x("nccl:all_reduce", 0.1, 0.2),
           x("c10d::allreduce_", 0.1, 0.3), x("cudaLaunchKernel", 0.02, 0.04, "cuda_runtime")]
    gpu = [x("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", 0, 10, "kernel", tid=7, pid=0),
           x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 5, 20, "kernel", tid=20, pid=0),
           x("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", 25, 30, "kernel", tid=20, pid=0),
           x("void at::native::vectorized_elementwise_kernel<4>", 22, 24, "kernel", tid=7, pid=0),
           x("Memcpy DtoD (Device -> Device)", 30, 40, "gpu_memcpy", tid=7, pid=0)]
    return {"distributedInfo": {"backend": "nccl", "rank": 3}, "traceEvents": cpu + gpu}


def test_nccl_kernels_are_communication_and_other_kernels_compute():
    events = trace.load(gpu_trace())
    comm = sorted(e["name"][:14] for e in events if is_comm(e, gpu=True))
    compute = sorted(e["name"][:14] for e in events if is_compute(e, gpu=True))
    assert comm == ["ncclDevKernel_", "ncclKernel_All"]
    assert compute == ["sm90_xmma_gemm", "void at::nativ"]
    cpu_side = [e for e in events if e["cat"] != "kernel"]      # launches, not the work
    assert cpu_side and not any(is_comm(e, gpu=True) or is_compute(e, gpu=True) for e in cpu_side)


def test_gpu_trace_summary_counts_device_time_only():
    s = summarize(gpu_trace())
    assert s.gpu and s.rank == 3
    # compute 0-10, 22-24; comm 5-20, 25-30 -> exposed 10-20 and 25-30; span 0-40
    assert (s.compute_s, s.comm_s, s.exposed_comm_s, s.span_s, s.idle_s) == \
        pytest.approx((0.012, 0.020, 0.015, 0.040, 0.040 - 0.027))
    assert not any(name.startswith(("aten::", "c10d::", "nccl:", "record_param")) for name, _, _ in s.top_ops)


# ---------------------------------------------------------------------------------------------
# real gloo traces: 2 ranks, recorded by tools/record_trace_fixture.py

@pytest.mark.parametrize("rank", [0, 1])
def test_real_gloo_trace(rank):
    path = FIXTURES / f"gloo-rank{rank}.json"
    assert path.stat().st_size < 200_000
    raw = json.loads(path.read_text())
    issued = raw["labkit"]["steps"] * raw["labkit"]["all_reduce_per_step"]
    events = trace.load(path)
    calls = [e for e in events if e["name"] == "c10d::allreduce_"]
    work = [e for e in events if e["name"] == "gloo:all_reduce"]
    assert len(calls) == len(work) == issued            # what the script issued, no more
    assert all(is_comm(e) for e in calls + work)
    main_thread = {e["tid"] for e in calls}
    assert len(main_thread) == 1 and not {e["tid"] for e in work} & main_thread   # gloo's own threads
    s = summarize(path)
    assert s.rank == rank and not s.gpu
    assert s.comm_s > 0 and s.compute_s > 0
    assert 0 <= s.exposed_comm_s <= s.comm_s + 1e-12
    assert s.idle_s >= 0 and s.compute_s + s.comm_s - (s.comm_s - s.exposed_comm_s) <= s.span_s + 1e-12
    ops = {name: n for name, _, n in s.top_ops}
    assert ops["gloo:all_reduce"] == issued
    per_step = [summarize(path, step=n) for n in trace.steps(path)]
    assert len(per_step) == raw["labkit"]["steps"]
    assert all({name: n for name, _, n in p.top_ops}["gloo:all_reduce"] == raw["labkit"]["all_reduce_per_step"]
               for p in per_step)
    assert sum(p.comm_s for p in per_step) <= s.comm_s + 1e-12


# ---------------------------------------------------------------------------------------------
# bad input

def test_a_file_that_is_not_a_trace(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not json at all")
    with pytest.raises(ValueError, match=r"notes\.txt is not a readable JSON trace.*export_chrome_trace"):
        summarize(bad)
    with pytest.raises(ValueError, match=r"not a readable JSON trace"):
        summarize(tmp_path / "missing.json")


def test_a_dict_without_trace_events():
    with pytest.raises(ValueError, match=r"needs a 'traceEvents' list, got keys \['events'\]"):
        trace.load({"events": []})


def test_events_without_ts_or_dur():
    with pytest.raises(ValueError, match=r"event 1 \('aten::mm'\) needs numeric 'ts' and 'dur'.*dur=None"):
        trace.load([x("aten::mm", 0, 1), {"ph": "X", "name": "aten::mm", "ts": 5}])
    with pytest.raises(ValueError, match=r"no complete \('X'\) events"):
        trace.load([{"ph": "M", "name": "thread_name"}])
    with pytest.raises(ValueError, match=r"cannot read a trace from a int"):
        trace.load(3)


def test_a_missing_step_lists_the_steps():
    events = [x("ProfilerStep#2", 0, 1, "user_annotation"), x("aten::mm", 0, 1)]
    with pytest.raises(ValueError, match=r"no ProfilerStep#7 in the trace; its steps: \[2\]"):
        summarize(events, step=7)


def test_summary_text_names_the_figures():
    text = summarize([x("aten::mm", 0, 10), x("gloo:all_reduce", 5, 25, "user_annotation", tid=2)]).text()
    assert "exposed" in text and "15.000 ms" in text and "gloo:all_reduce" in text
