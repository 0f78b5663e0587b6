"""labkit.pipeline_check: schedules written by hand in torch's CSV notation, checked with torch
2.13's own passes (_validate_schedule, _add_send_recv, _simulate_comms_compute) and explained in
words; each kind of mistake named with its rank, step, stage and micro-batch; custom schedules
simulated with labkit's event simulation, equal to `simulate` for torch's own orders."""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed.pipelining.schedules as S

from labkit.pipeline import check_schedule as lazy_check
from labkit.pipeline import simulate
from labkit.pipeline_check import (as_actions, check_schedule, read_schedule, simulate_schedule,
                                   write_schedule)

# 1F1B, p = 4, m = 8, by hand: rank i warms up with p - i - 1 forwards, then alternates.
ONE_F_ONE_B = """\
0F0,0F1,0F2,0F3,0B0,0F4,0B1,0F5,0B2,0F6,0B3,0F7,0B4,0B5,0B6,0B7
1F0,1F1,1F2,1B0,1F3,1B1,1F4,1B2,1F5,1B3,1F6,1B4,1F7,1B5,1B6,1B7
2F0,2F1,2B0,2F2,2B1,2F3,2B2,2F4,2B3,2F5,2B4,2F6,2B5,2F7,2B6,2B7
3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5,3F6,3B6,3F7,3B7
"""
# ZB-H1, p = 2, m = 4: the backward split into I and W; rank 0 defers one W.
ZB_H1 = {0: "0F0 0F1 0I0 0F2 0I1 0W0 0F3 0I2 0W1 0I3 0W2 0W3",
         1: "1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2 1F3 1I3 1W3"}
TWO = "0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1"          # p = 2, m = 2, rank 1 idle first


def stand_in(index, num_stages, rank, ranks):
    return types.SimpleNamespace(stage_index=index, num_stages=num_stages, group_rank=rank,
                                 group_size=ranks, is_first=index == 0,
                                 is_last=index == num_stages - 1, submod=torch.nn.Identity())


def v_schedule(cls, p, m):
    return cls([stand_in(0, 2 * p, 0, p), stand_in(2 * p - 1, 2 * p, 0, p)], m)


def edit(text: str, rank: int, step: int, new: str | None) -> dict:
    """TWO or another CSV with one field replaced (None: removed)."""
    rows = read_schedule(text)
    if new is None:
        del rows[rank][step]
    else:
        rows[rank][step] = new
    return rows


# ---- reading ----------------------------------------------------------------------------------
def test_read_write_and_every_notebook_form_give_the_same_rows(tmp_path):
    want = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["", "1F0", "1B0", "1F1", "1B1"]}
    assert read_schedule(TWO) == want
    path = write_schedule(want, tmp_path / "two.csv")
    assert read_schedule(path) == read_schedule(str(path)) == want
    assert as_actions({0: "0F0 0F1 0B0 0B1", 1: ",1F0,1B0,1F1,1B1"}) == want
    assert as_actions([["0F0", "0F1", "0B0", "0B1"], [None, "1F0", "1B0", "1F1", "1B1"]]) == want
    assert as_actions(TWO) == want


def test_torch_pipeline_order_is_read_as_is():
    z = v_schedule(S.ScheduleZBVZeroBubble, 2, 4)
    rows = as_actions(z.pipeline_order)
    assert rows[1][0] == "" and rows[0][:3] == ["0F0", "0F1", "0F2"]
    d = as_actions(v_schedule(S.ScheduleDualPipeV, 2, 4).pipeline_order)
    assert any(a.endswith(")OVERLAP_F_B") for a in d[0])


@pytest.mark.parametrize("bad, message", [
    (42, "allowed: a dict {rank: actions}"), ({"a": "0F0"}, "rank 'a' is not a rank"),
    ("no_such_file.csv", "schedule file 'no_such_file.csv' does not exist")])
def test_what_cannot_be_read_is_a_message(bad, message):
    with pytest.raises(ValueError, match=message):
        as_actions(bad)


# ---- valid schedules --------------------------------------------------------------------------
@pytest.mark.parametrize("actions, stages, m, ranks", [
    (ONE_F_ONE_B, 4, 8, {s: s for s in range(4)}),
    (ZB_H1, 2, 4, {0: 0, 1: 1}),
    (TWO, 2, 2, {0: 0, 1: 1}),
])
def test_valid_schedules_pass(actions, stages, m, ranks):
    got = check_schedule(actions, stages, m)
    assert got.ok and got.problems == [] and got.stage_to_rank == ranks, got.text()
    assert "the schedule is valid" in str(got)
    assert lazy_check(actions, stages, m) == got


@pytest.mark.parametrize("cls, p, m", [(S.ScheduleZBVZeroBubble, 4, 8),
                                       (S.ScheduleDualPipeV, 2, 4),
                                       (S.ScheduleInterleavedZeroBubble, 4, 8)])
def test_torch_own_schedules_pass(cls, p, m):
    if cls is S.ScheduleInterleavedZeroBubble:
        schedule, stages = cls([stand_in(0, p, 0, p)], m), p
    else:
        schedule, stages = v_schedule(cls, p, m), 2 * p
    got = check_schedule(schedule.pipeline_order, stages, m)
    assert got.ok, got.text()
    assert got.stage_to_rank == schedule.stage_index_to_group_rank


def test_torch_1f1b_visualisation_is_caught_on_its_last_rank():
    """Schedule1F1B.pipeline_order numbers the last rank's forwards 1..m (test_pp_torch_order):
    check_schedule says so, where torch's own _validate_schedule lets it through."""
    got = check_schedule(S.Schedule1F1B(stand_in(0, 4, 0, 4), 8).pipeline_order, 4, 8)
    assert not got.ok
    assert got.problems == ["rank 3, step 14: 3F8 names micro-batch 8; microbatches=8 allows "
                            "0 to 7"]


# ---- each class of mistake, in words ------------------------------------------------------------
MISTAKES = [
    ("malformed", edit(TWO, 1, 3, "1Fx"), "rank 1, step 3: '1Fx' is not an action",
     "torch reads '1Fx' as '1F'"),
    ("no micro-batch", edit(TWO, 0, 2, "0B"), "rank 0, step 2: '0B' has no micro-batch", None),
    ("trailing text", edit(TWO, 0, 0, "0F0;"), "rank 0, step 0: '0F0;' is not an action",
     "torch reads '0F0;' as '0F0'"),
    ("unknown kind", edit(TWO, 0, 1, "0X1"), "rank 0, step 1: '0X1' is not an action",
     "RuntimeError: Invalid action string: 0X1"),
    ("communication", edit(TWO, 1, 4, "1SEND_B1"), "'1SEND_B1' is a communication action", None),
    ("B before F", read_schedule("0F0,0F1,0B0,0B1\n,1B0,1F0,1F1,1B1"),
     "rank 1, step 1: 1B0 (full backward of stage 1, micro-batch 0) comes before its forward "
     "1F0 (rank 1, step 2)", "Running Full Backward for stage 1, microbatch 0 without first"),
    ("I before F", read_schedule("0F0,0F1,0I0,0W0,0I1,0W1\n1I0,1F0,1W0,1F1,1I1,1W1"),
     "rank 1, step 0: 1I0 (input gradient of stage 1, micro-batch 0) comes before its forward",
     "Running Backward Input for stage 1, microbatch 0"),
    ("W before I", read_schedule("0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1W0,1F1,1W1,1I1"),
     "rank 1, step 4: the weight gradient 1W1 comes before the input gradient 1I1 (it runs "
     "later, at step 5)", "Running Backward Weight for stage 1, microbatch 1"),
    ("W after a full B", read_schedule("0F0,0F1,0B0,0W0,0B1\n,1F0,1B0,1F1,1B1"),
     "rank 0, step 3: 0W0 follows a full backward 0B0 (rank 0, step 2)", "Backward Weight"),
    ("I without W", read_schedule("0F0,0F1,0I0,0W0,0I1\n1F0,1I0,1W0,1F1,1I1,1W1"),
     "stage 0 has 2 input gradients (I) and 1 weight gradients (W): micro-batch 1 has I "
     "without W", "I and W must have equal counts"),
    ("missing forward", edit(TWO, 1, 3, ""), "rank 1, step 4: 1B1 (full backward of stage 1, "
     "micro-batch 1) comes before its forward 1F1 (missing)", "Running Full Backward"),
    ("missing forward and backward", read_schedule("0F0,0F1,0B0,0B1\n,1F0,1B0"),
     "stage 1 has no forward of micro-batch 1", "microbatches for stage 1, expected 2"),
    ("missing backward", edit(TWO, 1, 4, None), "stage 1 has no backward of micro-batch 1",
     "expected 2 total backwards"),
    ("duplicated", read_schedule(TWO + ",1B1"), "rank 1 runs 1B1 twice (steps 4 and 5)", None),
    ("stage on two ranks", read_schedule("0F0,0F1,0B0,0B1,1F0\n,1B0,1F1,1B1"),
     "stage 1 is on rank 0 and on rank 1 (step 1)", "Stage 1 is assigned to both rank 1 and"),
    ("micro-batch out of range", edit(TWO, 1, 4, "1B2"),
     "rank 1, step 4: 1B2 names micro-batch 2; microbatches=2 allows 0 to 1", None),
    ("stage out of range", edit(TWO, 1, 4, "2B1"),
     "rank 1, step 4: 2B1 names stage 2; stages=2 allows 0 to 1", None),
    ("empty rank", read_schedule("0F0,0F1,0B0,0B1\n\n,1F0,1B0,1F1,1B1"),
     "rank 1 has no action", None),
    ("missing rank", {0: "0F0 0F1 0B0 0B1", 2: "1F0 1B0 1F1 1B1"},
     "2 rows for ranks 0 to 2: each rank needs a row", "incorrect number of ranks"),
    ("deadlock", read_schedule("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0"),
     "deadlock between ranks 0 and 1: each waits for another, so no rank can go on. rank 0 "
     "stops at step 1 (0B0): it needs the gradient of 1I0 or 1B0, which rank 1 runs at step 3; "
     "rank 1 stops at step 0 (1F1): it needs the activations of 0F1, which rank 0 runs at "
     "step 2", "Malformed compute schedule, can't schedule sends/recvs"),
]


@pytest.mark.parametrize("name, actions, words, torch_says", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_is_named(name, actions, words, torch_says):
    got = check_schedule(actions, 2, 2)
    assert not got.ok
    assert any(words in p for p in got.problems), got.text()
    if torch_says:
        assert torch_says in got.torch_error
    assert words in got.text()


def test_a_stage_no_rank_holds_is_named():
    got = check_schedule(TWO, 3, 2)
    assert not got.ok and got.problems == ["stage 2 has no action at all: each stage 0 to "
                                           "stages - 1 needs its actions in one rank's row"]
    assert "microbatches for stage 2, expected 2" in got.torch_error


def test_a_deadlock_in_a_v_schedule_names_the_ranks_and_steps():
    """ZB-V, p = 4, m = 8: rank 1 runs its chunk-1 forward of micro-batch 0 (stage 6) before it
    has the input from stage 5, which rank 2 sends only after waiting on rank 1."""
    rows = as_actions(v_schedule(S.ScheduleZBVZeroBubble, 4, 8).pipeline_order)
    assert check_schedule(rows, 8, 8).ok
    r1 = [a for a in rows[1] if a]
    rows[1] = ["6F0"] + [a for a in r1 if a != "6F0"]
    got = check_schedule(rows, 8, 8)
    words = got.problems[0]
    assert not got.ok and words.startswith("deadlock between ranks 1 and 2"), got.text()
    assert "rank 1 stops at step 0 (6F0): it needs the activations of 5F0, which rank 2 runs" \
        in words
    assert "rank 2 stops at step 2 (2F0): it needs the activations of 1F0" in words
    assert words.endswith("Behind them wait ranks 0, 3")


def test_a_rank_waiting_on_itself_is_named():
    """The V's tip: rank p - 1 holds stages p - 1 and p; stage p's forward before p - 1's."""
    rows = as_actions(v_schedule(S.ScheduleZBVZeroBubble, 2, 4).pipeline_order)
    row = [a for a in rows[1] if a]
    i, j = row.index("1F0"), row.index("2F0")
    row[i], row[j] = row[j], row[i]
    rows[1] = row
    got = check_schedule(rows, 4, 4)
    assert not got.ok and "2F0" in got.problems[0] and "rank 1" in got.problems[0], got.text()


# ---- simulating -------------------------------------------------------------------------------
def test_simulate_schedule_equals_simulate_for_labkit_and_torch_orders():
    same = [
        (ONE_F_ONE_B, {}, simulate("1f1b", 4, 8, 1.0, 2.0)),
        (S.ScheduleInterleaved1F1B([stand_in(c * 4, 8, 0, 4) for c in (0, 1)], 8).pipeline_order,
         {}, simulate("interleaved-1f1b", 4, 8, 1.0, 2.0, chunks=2)),
        (S.ScheduleInterleavedZeroBubble([stand_in(0, 4, 0, 4)], 8).pipeline_order,
         {"bwd": 1.0, "wgrad": 1.0}, simulate("zero-bubble", 4, 8, 1.0, 1.0, wgrad=1.0)),
        (v_schedule(S.ScheduleZBVZeroBubble, 4, 8).pipeline_order,
         {"bwd": 2.0, "wgrad": 0.5}, simulate("zbv", 4, 8, 1.0, 2.0, wgrad=0.5)),
        (v_schedule(S.ScheduleDualPipeV, 4, 8).pipeline_order,
         {"bwd": 2.0, "wgrad": 0.5}, simulate("dualpipev", 4, 8, 1.0, 2.0, wgrad=0.5)),
    ]
    for actions, kw, want in same:
        got = simulate_schedule(actions, fwd=1.0, **{"bwd": 2.0, **kw})
        assert got.makespan == pytest.approx(want.makespan)
        assert got.bubble_fraction == pytest.approx(want.bubble_fraction)
        assert got.peak_chunks == want.peak_chunks


def test_costs_per_stage_and_a_full_backward_is_i_plus_w():
    r = simulate_schedule(TWO, fwd=1.0, bwd=2.0)               # no I or W: B is the backward
    assert r.makespan == pytest.approx(simulate("1f1b", 2, 2, 1.0, 2.0).makespan) == 9.0
    split = simulate_schedule(TWO, fwd=1.0, bwd=2.0, wgrad=1.0)    # B = I + W: 3 a pass
    assert split.makespan == pytest.approx(12.0)
    assert [e.kind for e in split.events if e.stage == 1][:3] == ["F", "B", "W"]
    assert split.peak_chunks == [2, 1] and split.peak_in_flight == [2.0, 1.0]


def test_an_invalid_schedule_is_not_simulated():
    with pytest.raises(ValueError, match="deadlock between ranks 0 and 1"):
        simulate_schedule("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0")
    with pytest.raises(ValueError, match="'0Q0' is not an action"):
        simulate_schedule(edit(TWO, 0, 0, "0Q0"))
