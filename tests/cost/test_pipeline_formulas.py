"""labkit.pipeline's closed forms against its simulator, and the pitfalls of module 07 (issue 18)
computed: bubble_formula, min_microbatches, activation_in_flight, activation_memory,
p2p_messages, idle_share."""
from __future__ import annotations

from collections import Counter
import math

import pytest

from labkit.comm import step_communication
from labkit.memory import estimate_memory
from labkit.pipeline import (activation_in_flight, activation_memory, bubble_formula,
                             idle_share, min_microbatches, p2p_messages, simulate)

GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


def _simulated(schedule, p, m, v=1):
    """The simulation in the formulas' setting: equal times (f = b = w for zero-bubble)."""
    if schedule == "zero-bubble":
        return simulate(schedule, p, m, fwd=1.0, bwd=1.0, wgrad=1.0)
    return simulate(schedule, p, m, fwd=1.0, bwd=2.0, chunks=v)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
@pytest.mark.parametrize("p, m", GRID)
def test_formula_equals_the_simulation(schedule, p, m):
    r = _simulated(schedule, p, m)
    share, relative = bubble_formula(schedule, p, m)
    assert share == pytest.approx(r.bubble_fraction, abs=1e-12)
    assert relative == pytest.approx(r.bubble_ratio, abs=1e-12)
    assert activation_in_flight(schedule, p, m) == r.peak_in_flight


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_formula_equals_the_simulation(p, k, v):
    m = k * p
    r = _simulated("interleaved-1f1b", p, m, v)
    share, relative = bubble_formula("interleaved-1f1b", p, m, v)
    assert (share, relative) == pytest.approx((r.bubble_fraction, r.bubble_ratio), abs=1e-12)
    assert activation_in_flight("interleaved-1f1b", p, m, v) == r.peak_in_flight
    # divided by v, not halved: the same micro-batches without interleaving
    assert relative == pytest.approx(bubble_formula("1f1b", p, m)[1] / v)


def test_four_stages_eight_microbatches_by_hand():
    """"4 stages, 8 micro-batches: 37.5 % bubble": the step is (m + p - 1)(f + b) = 11 units
    of which each stage works m (f + b) = 8: 3/11 = 27.3 % of the step idle; 37.5 % = 3/8 is
    the bubble relative to the ideal 8 units."""
    r = simulate("1f1b", 4, 8, fwd=1.0, bwd=2.0)
    step, work = r.makespan, sum(r.busy) / 4
    assert (step, work) == (33.0, 24.0)                        # 11 x 3, 8 x 3
    share, relative = bubble_formula("1f1b", 4, 8)
    assert f"{100 * share:.1f} %" == "27.3 %" and share == pytest.approx(1 - work / step)
    assert f"{100 * relative:.1f} %" == "37.5 %" and relative == pytest.approx(step / work - 1)


def test_1f1b_has_gpipe_s_bubble_and_bounds_memory():
    """"1F1B minimizes the bubble": no, the same bubble as GPipe; it holds p - i micro-batches
    on stage i instead of all m."""
    for p, m in GRID:
        assert bubble_formula("1f1b", p, m) == bubble_formula("gpipe", p, m)
    assert activation_in_flight("gpipe", 4, 16) == [16.0] * 4
    assert activation_in_flight("1f1b", 4, 16) == [4.0, 3.0, 2.0, 1.0]
    gpipe, one = (activation_memory("llama2-7b", s, 4, 16, seq_len=1024)
                  for s in ("gpipe", "1f1b"))
    assert gpipe[0] == pytest.approx(4 * one[0]) and gpipe[3] == pytest.approx(16 * one[3])


def test_pp2_with_16_microbatches_is_not_11_percent():
    """"PP-2, 16 micro-batches: ~11 % bubble": 1/17 = 5.9 % of the step (6.25 % relative)."""
    r = simulate("1f1b", 2, 16, fwd=1.0, bwd=2.0)
    idle = 1 - sum(r.busy) / (2 * r.makespan)                 # one unit idle of 17 per stage
    share, relative = bubble_formula("1f1b", 2, 16)
    assert share == pytest.approx(idle) == pytest.approx(1 / 17)
    assert relative == pytest.approx(1 / 16)
    assert max(share, relative) < 0.11 / 1.7
    assert min_microbatches(2, 0.11) == 9                     # 1/(9 + 1) <= 11 % < 1/(8 + 1)


def test_pp8_with_16_microbatches_is_not_acceptable():
    """"PP8 with 16 micro-batches: 44 %, acceptable": 44 % is 7/16 relative to the ideal (the
    step takes 1.44x the work); 7/23 = 30.4 % of every GPU's time idle. 10 % of the step
    needs 63 micro-batches, 10 % relative 70."""
    r = simulate("1f1b", 8, 16, fwd=1.0, bwd=2.0)
    share, relative = bubble_formula("1f1b", 8, 16)
    assert round(100 * relative) == 44 and r.makespan / r.ideal == pytest.approx(1 + 7 / 16)
    assert f"{100 * share:.1f}" == "30.4"
    m = min_microbatches(8, 0.10)
    assert bubble_formula("1f1b", 8, m)[0] <= 0.10 < bubble_formula("1f1b", 8, m - 1)[0]
    assert (m, min_microbatches(8, 0.10, relative=True)) == (63, 70)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_naive_pipeline_uses_one_stage_in_p(p):
    """"Naive utilisation 1 - 1/k": with one micro-batch a single stage works at a time, so the
    GPUs are busy 1/p of the step, not 1 - 1/p."""
    r = simulate("gpipe", p, 1, fwd=1.0, bwd=2.0)
    ops = sorted(r.events, key=lambda e: e.start)
    assert all(a.end <= b.start for a, b in zip(ops, ops[1:]))   # never two stages at once
    assert 1 - bubble_formula("gpipe", p, 1)[0] == pytest.approx(1 / p)
    assert 1 - r.bubble_fraction == pytest.approx(1 / p)
    if p > 2:
        assert 1 - r.bubble_fraction < 1 - 1 / p


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved-1f1b", 2),
                                         ("interleaved-1f1b", 4), ("zero-bubble", 1)])
@pytest.mark.parametrize("target", [0.5, 0.25, 0.1, 0.05, 0.011])
@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_min_microbatches_is_the_smallest(schedule, v, target, relative, p):
    m = min_microbatches(p, target, schedule, v, relative=relative)
    step = p if schedule == "interleaved-1f1b" else 1
    assert m % step == 0
    at = 1 if relative else 0
    assert bubble_formula(schedule, p, m, v)[at] <= target
    if m > step:                                             # one step fewer misses it
        assert bubble_formula(schedule, p, m - step, v)[at] > target


def test_interleaving_multiplies_p2p_by_v_and_leaves_the_all_reduce():
    """"Interleaving halves the bubble and doubles all-reduce": the bubble divides by v, the
    point-to-point sends of a middle rank multiply by v, the gradient all-reduce is the
    same."""
    for v in (2, 3, 4):
        assert p2p_messages(4, 8, v).busiest_rank == v * p2p_messages(4, 8).busiest_rank
        comm = [step_communication("ddp", "llama2-7b", pp=4, dp=8, chunks=c).total_bytes
                for c in (1, v)]
        assert comm[0] == comm[1]


@pytest.mark.parametrize("p, m, v", [(2, 4, 1), (4, 8, 1), (4, 8, 2), (2, 4, 3), (3, 6, 2),
                                     (1, 5, 1), (8, 16, 4)])
def test_p2p_messages_count_the_simulated_crossings(p, m, v):
    """Each forward on a virtual stage but the last sends, each backward but the first's."""
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    r = simulate(schedule, p, m, chunks=v)
    last = p * v - 1
    sends = Counter(e.stage for e in r.events
                    if (e.kind == "F" and e.chunk * p + e.stage != last)
                    or (e.kind == "B" and e.chunk * p + e.stage != 0))
    got = p2p_messages(p, m, v)
    assert got.total == sum(sends.values())
    assert got.busiest_rank == max(sends.values(), default=0)
    if p > 1:                                                # as the communication model counts
        comm = step_communication("pp", "llama2-7b", pp=p, microbatches=m, chunks=v)
        assert comm.collectives[0].count == got.busiest_rank


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(4, 8), (2, 2), (8, 3), (1, 4)])
def test_activation_memory_is_estimate_memory_s(schedule, p, m):
    """The worst stage's activations are estimate_memory's; on every stage, the total minus
    these activations (the model states) is the same whatever the schedule and m."""
    kw = dict(batch_size=2, seq_len=1024)
    acts = activation_memory("llama2-7b", schedule, p, m, **kw)
    est = estimate_memory("llama2-7b", pp=p, microbatches=m, schedule=schedule, **kw)
    assert acts[est.stage] == pytest.approx(est.activations, rel=1e-9)
    other = estimate_memory("llama2-7b", pp=p, microbatches=m + 5, schedule="gpipe", **kw)
    more = activation_memory("llama2-7b", "gpipe", p, m + 5, **kw)
    for total, a, total2, a2 in zip(est.per_stage, acts, other.per_stage, more):
        assert total - a == pytest.approx(total2 - a2, rel=1e-9)
        assert a > 0


def test_idle_share_of_a_measured_event_list():
    r = simulate("gpipe", 4, 8)
    rows = [dict(stage=e.stage, kind=e.kind, microbatch=e.microbatch, start=e.start + 5.0,
                 end=e.end + 5.0) for e in r.events]          # a measured run's clock
    assert idle_share(rows) == pytest.approx(r.bubble_fraction)
    # one stage missing from the list: say how many ran
    rest = [e for e in rows if e["stage"] != 3]
    assert idle_share(rest, stages=4) > idle_share(rest)
    assert math.isclose(idle_share(r), r.bubble_fraction)


@pytest.mark.parametrize("call, says", [
    (lambda: bubble_formula("pipedream", 4, 8), "schedule='pipedream' is not supported"),
    (lambda: bubble_formula("1f1b", 0, 8), "p=0 must be a whole number >= 1"),
    (lambda: bubble_formula("1f1b", 4, 2.5), "m=2.5 must be a whole number"),
    (lambda: bubble_formula("1f1b", 4, 8, 2), "v=2 needs schedule='interleaved-1f1b'"),
    (lambda: bubble_formula("interleaved-1f1b", 4, 6, 2), "m=6 must be a multiple of p=4"),
    (lambda: min_microbatches(4, 0), r"target=0 must be a number >= 1e-06 and <= 1"),
    (lambda: min_microbatches(4, 1.5), r"target=1.5 must be a number >= 1e-06 and <= 1"),
    (lambda: min_microbatches(4, float("nan")), "target=nan"),
    (lambda: min_microbatches(10**5, 1e-6, "1f1b"),
     r"target=1e-06 needs [\d,]{14} micro-batches for p=100000"),
    (lambda: activation_in_flight("1f1b", -1, 8), "p=-1"),
    (lambda: activation_memory("llama2-7b", "1f1b", 4, 8, pp=2), "pp= is set by p, m"),
    (lambda: activation_memory("gpt2", "interleaved-1f1b", 4, 8, 4),
     "p x v = 16 virtual stages is more than num_layers=12"),
    (lambda: activation_memory("gpt2", "1f1b", 16, 8), "pp=16 is larger than num_layers=12"),
    (lambda: p2p_messages(4, 0), "m=0 must be a whole number >= 1"),
    (lambda: p2p_messages(10**4, 8, 100), "p x v = 1,000,000 virtual stages"),
    (lambda: idle_share([]), r"events=\[\] has no event"),
    (lambda: idle_share([{"stage": 0}]), "is not an Event or a dict with stage, kind"),
])
def test_bad_input_is_a_message_naming_the_argument(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_min_microbatches_takes_the_target_as_written():
    """0.12 as a float is just below 3/25; a bubble of exactly 12 % must still meet it:
    p=16: 15/(m+15) <= 0.12 first at m = 110 (15/125 = 0.12 exactly)."""
    from fractions import Fraction

    from labkit.pipeline import min_microbatches

    assert Fraction(15, 110 + 15) == Fraction(3, 25)
    assert min_microbatches(16, 0.12) == 110
    assert min_microbatches(8, 0.10) == 63           # 7/70
    assert min_microbatches(8, 0.10, relative=True) == 70
