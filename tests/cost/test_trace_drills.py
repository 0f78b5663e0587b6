"""labkit.trace_drills: each question's answer on crafted traces whose answer is known by
construction, on a synthetic NCCL trace, and on the real 2-rank gloo fixture (checked against
what tools/record_trace_fixture.py says it issued)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import trace_drills as drills
from labkit.trace import intervals, subtract, summarize

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
RANKS = [FIXTURES / f"gloo-rank{r}.json" for r in (0, 1)]
MS = 1000.0


def x(name, a, b, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": a * MS, "dur": (b - a) * MS}


def step(n, a, b):
    return x(f"ProfilerStep#{n}", a, b, "user_annotation")


@pytest.mark.parametrize("name, expected", [
    ("gloo:all_reduce", "all_reduce"), ("c10d::allreduce_", "all_reduce"),
    ("c10d::_allgather_base_", "all_gather"), ("gloo:all_gather", "all_gather"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_reduce"), ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"), ("nccl:all_to_all", "all_to_all"),
    ("gloo:recv", "recv"), ("gloo:send", "send"), ("ncclDevKernel_SendRecv", "send_recv"),
    ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"), ("gloo:broadcast", "broadcast"),
    ("gloo:barrier", "barrier"), ("c10d::reduce_", "reduce"), ("something_else", "something_else"),
])
def test_kind_normalises_every_spelling(name, expected):
    assert drills.kind(name) == expected


@pytest.mark.parametrize("a, b, expected", [
    ([(0, 10)], [(2, 3), (5, 6)], [(0, 2), (3, 5), (6, 10)]),
    ([(0, 10)], [(0, 10)], []),
    ([(0, 4), (6, 10)], [(3, 7)], [(0, 3), (7, 10)]),
    ([(0, 10)], [], [(0, 10)]),
    ([(5, 6)], [(0, 1), (8, 9)], [(5, 6)]),
])
def test_subtract_is_exact(a, b, expected):
    assert subtract(a, b) == expected


# a DDP-like step: backward compute 0-10 ms, two buckets all-reduced 4-8 (hidden) and 12-16
# (after the backward: exposed), the optimizer 16-18; then a second step with nothing hidden
TWO_STEPS = [step(1, 0, 20), x("aten::mm", 0, 10), x("gloo:all_reduce", 4, 8, "user_annotation", 2),
             x("gloo:all_reduce", 12, 16, "user_annotation", 2), x("aten::add_", 16, 18),
             step(2, 20, 40), x("aten::mm", 20, 30), x("gloo:all_reduce", 30, 38, "user_annotation", 2),
             x("gloo:broadcast", 38, 39, "user_annotation", 2), x("c10d::allreduce_", 30, 30.1)]


def test_collectives_count_time_and_exposed_per_kind():
    one = drills.collectives(TWO_STEPS, step=1)
    assert set(one) == {"all_reduce"}
    assert (one["all_reduce"].count, one["all_reduce"].seconds, one["all_reduce"].exposed_s) == \
        pytest.approx((2, 0.008, 0.004))
    two = drills.collectives(TWO_STEPS, step=2)
    assert two["all_reduce"].count == 1 and two["broadcast"].count == 1   # the c10d enqueue: not counted
    assert drills.most_exposed(TWO_STEPS, step=2) == "all_reduce"
    assert drills.exposed_per_step(TWO_STEPS) == pytest.approx({1: 0.004, 2: 0.009})


def test_overlap_is_the_hidden_share():
    assert drills.overlap(TWO_STEPS, step=1) == pytest.approx(0.5)
    assert drills.overlap(TWO_STEPS, step=2) == 0.0     # the all-reduce starts as compute ends
    with pytest.raises(ValueError, match="no communication"):
        drills.overlap([x("aten::mm", 0, 1)])


def test_straggler_is_the_rank_the_others_wait_for():
    # rank 1 computes 10 ms longer; ranks 0 and 2 enter the all-reduce early and wait for it
    def rank(compute_ms):
        return [step(1, 0, 30), x("aten::mm", 0, compute_ms),
                x("gloo:all_reduce", compute_ms, 25, "user_annotation", 2)]
    s = drills.straggler([rank(10), rank(20), rank(12)])
    assert s.rank == 1
    assert s.wait_s == pytest.approx({0: 0.015, 1: 0.005, 2: 0.013})
    assert s.late_s == pytest.approx({0: 0.0, 1: 0.010, 2: 0.002})
    assert "straggler: rank 1" in s.text()
    with pytest.raises(ValueError, match="2 or more"):
        drills.straggler([rank(1)])


def test_bubble_splits_warmup_drain_and_gaps():
    # a last pipeline stage: waits 6 ms for its first input, computes, waits 2, computes, drains 3
    events = [step(1, 0, 20), x("gloo:recv", 0, 6, "user_annotation"), x("aten::mm", 6, 10),
              x("gloo:recv", 10, 12, "user_annotation"), x("labkit::compute_sleep", 12, 17, "user_annotation")]
    b = drills.bubble(events, step=1)
    assert (b.span_s, b.no_compute_s, b.before_s, b.after_s) == pytest.approx((0.020, 0.011, 0.006, 0.003))
    assert b.gaps == [pytest.approx((0.010, 0.002))] and b.share == pytest.approx(0.55)
    assert drills.bubble(events, step=1, min_gap_s=0.005).gaps == []


def test_nccl_gpu_trace_counts_kernels_only():
    events = [x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 5, 15, "kernel", 7), x("sm90_gemm", 0, 10, "kernel", 8),
              x("record_param_comms", 4, 4.5), x("nccl:all_reduce", 4, 4.6)]
    found = drills.collectives(events)
    assert list(found) == ["all_reduce"] and found["all_reduce"].exposed_s == pytest.approx(0.005)


# ---------------------------------------------------------------------------------------------
# the real gloo fixture (2 ranks, 2 steps, 3 all-reduces per step: 2 by hand + 1 DDP bucket)

def test_real_trace_counts_what_the_script_issued():
    meta = json.loads(RANKS[0].read_text())["labkit"]
    for path in RANKS:
        for n in (2, 3):
            found = drills.collectives(path, step=n)
            assert found["all_reduce"].count == meta["all_reduce_per_step"], (path.name, n, found)
        assert drills.issued(path, "c10d::allreduce_") == meta["steps"] * meta["all_reduce_per_step"]


def test_real_trace_nothing_overlaps_since_all_reduces_follow_the_backward():
    # the script all-reduces by hand after backward, and DDP's one bucket is ready only when the
    # backward ends: any overlap is a few enqueue microseconds, never most of the time
    for path in RANKS:
        assert drills.overlap(path, step=3) < 0.5


def test_real_trace_straggler_agrees_with_waits_and_summaries():
    s = drills.straggler(RANKS, step=3)
    sums = [summarize(p, step=3) for p in RANKS]
    other = 1 - s.rank
    assert s.wait_s[s.rank] <= s.wait_s[other]
    assert s.wait_s[other] <= sums[other].comm_s + 1e-9      # the work events are part of comm


def test_lanes_are_disjoint_and_exposed_within_comm():
    lanes = intervals(RANKS[1], step=2)
    for iv in (lanes.compute, lanes.comm, lanes.exposed):
        assert all(a < b for a, b in iv) and all(iv[i][1] < iv[i + 1][0] for i in range(len(iv) - 1))
    assert subtract(lanes.exposed, lanes.comm) == []


def test_a_collective_is_counted_in_the_step_it_starts_in():
    # step 1's all-reduce ends 0.01 ms into step 2 (gloo's thread closes its range late): step 2
    # counts its own one, and the overhang's time still shows as communication in step 2
    events = [step(1, 0, 10), x("gloo:all_reduce", 6, 10.01, "user_annotation", 2),
              step(2, 10, 20), x("gloo:all_reduce", 15, 18, "user_annotation", 2)]
    assert drills.collectives(events, step=1)["all_reduce"].count == 1
    two = drills.collectives(events, step=2)["all_reduce"]
    assert two.count == 1 and two.seconds == pytest.approx(0.00301)


def test_backward_lead_says_whether_a_collective_began_during_the_backward():
    node = "autograd::engine::evaluate_function: AddmmBackward0"
    bucketed = [step(1, 0, 30), x(node, 0, 6), x(node, 6, 12), x("gloo:all_reduce", 7, 14, "user_annotation", 2),
                x("gloo:all_reduce", 13, 18, "user_annotation", 2)]
    # DDP's hook launches the one bucket inside the last AccumulateGrad node, which outlasts it
    one_bucket = [step(1, 0, 30), x(node, 0, 6), x(node, 6, 12), x("gloo:all_reduce", 12.5, 20, "user_annotation", 2),
                  x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 12, 16)]
    assert drills.backward_lead(bucketed, step=1) == pytest.approx(0.005)
    assert drills.backward_lead(one_bucket, step=1) == pytest.approx(-0.0005)
    with pytest.raises(ValueError, match="no autograd node"):
        drills.backward_lead([step(1, 0, 5), x("gloo:all_reduce", 1, 2, "user_annotation", 2)], step=1)
    with pytest.raises(ValueError, match="no collective"):
        drills.backward_lead([step(1, 0, 5), x(node, 1, 2)], step=1)


def test_an_isend_span_open_across_later_compute_does_not_swallow_it():
    # gloo:send on the caller's thread spans from the isend (inside c10d::send) to its completion
    # at the step's end; the stage's compute after the post is still compute
    events = [step(1, 0, 100), x("aten::mm", 0, 10), x("c10d::send", 10, 11), x("gloo:send", 10.5, 99, "user_annotation"),
              x("labkit::compute_sleep", 20, 40, "user_annotation"), x("aten::mm", 50, 60)]
    s = summarize(events, step=1)
    assert s.compute_s == pytest.approx(0.040)
    assert drills.bubble(events, step=1).no_compute_s == pytest.approx(0.060)
