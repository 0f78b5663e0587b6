"""labkit.pipeline's V schedules (zbv, dualpipev) against their closed forms: the bubble and peak
memory labkit states (bubble_formula, activation_in_flight, labkit.pipeline_v), the papers'
bubble (paper_bubble: ZB-V, Qi et al. 2024 §6; DualPipe's README table, DeepSeek-AI 2024), with
where they agree and where they do not; and a check that each comparison can fail."""
from __future__ import annotations

import pytest

from labkit.pipeline import (activation_in_flight, bubble_formula, min_microbatches,
                             paper_bubble, simulate)
from labkit.pipeline_events import run_orders
from labkit.pipeline_v import v_peak_chunks, v_place, zbv_orders

GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in range(1, 4 * p + 2)]


def same_bubble(schedule, p, m, r) -> bool:
    """Does the simulated step r (f = b = w) have bubble_formula's bubble, relative and share?"""
    share, rel = bubble_formula(schedule, p, m)
    return r.bubble_ratio == pytest.approx(rel, abs=1e-12) and \
        r.bubble_fraction == pytest.approx(share, abs=1e-12)


@pytest.mark.parametrize("schedule, p, m", [("zbv", p, m) for p, m in GRID] +
                         [("dualpipev", p, m) for p, m in GRID if m >= 2 * p])
def test_simulation_has_the_closed_form_bubble_and_peak(schedule, p, m):
    r = simulate(schedule, p, m, fwd=1.0, bwd=1.0, wgrad=1.0)
    assert same_bubble(schedule, p, m, r)
    assert r.peak_chunks == v_peak_chunks(schedule, p, m)
    halves = [k / 2 for k in r.peak_chunks]
    assert r.peak_in_flight == activation_in_flight(schedule, p, m) == halves


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_matches_the_paper_at_equal_times(p):
    """Qi et al. §6: ZB-V's bubble is (p - 1)(T_F + T_B - 2 T_W), zero at equal times, with
    1F1B's peak memory, p micro-batches of a whole stage (2p chunks), on every rank. The zero
    is the idle inside each rank's span: one step from a common start still has the last rank
    start (p - 1) chunk forwards late, (p - 1) f/2 in all, (p - 1)/(6m) of the ideal."""
    m = 4 * p
    r = simulate("zbv", p, m, fwd=1.0, bwd=1.0, wgrad=1.0)
    assert max(r.span_idle) == paper_bubble("zbv", p, 1.0, 1.0, 1.0) == 0.0
    assert r.makespan - r.ideal == pytest.approx((p - 1) * 0.5)
    assert r.peak_chunks == [2 * p] * p
    one = simulate("1f1b", p, m, fwd=1.0, bwd=2.0)
    assert max(r.peak_in_flight) == max(one.peak_in_flight) == p


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipev_matches_deepseek_at_equal_times(p):
    """DualPipe README: bubble (PP/2 - 1)(F&B + B - 3W), activations PP + 1 (chunks), against
    1F1B's (PP - 1)(F + B) and PP. For DualPipeV PP = 2p stages on p ranks; torch runs an
    overlapped pair one pass after the other, so F&B = F + B (B a full backward)."""
    m = 4 * p
    r = simulate("dualpipev", p, m, fwd=1.0, bwd=1.0, wgrad=1.0)
    assert max(r.span_idle) == pytest.approx(paper_bubble("dualpipev", p, 1.0, 1.0, 1.0))
    assert r.makespan - r.ideal == pytest.approx((p - 1) * 1.0)
    assert r.peak_chunks == [2 * p + 1] * p
    one = simulate("1f1b", p, m, fwd=1.0, bwd=2.0)
    assert one.makespan - one.ideal == pytest.approx(paper_bubble("1f1b", p, 1.0, 1.0, 1.0))


@pytest.mark.parametrize("f, b, w", [(1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 3.0)])
def test_1f1b_matches_its_formula_at_any_ratio(f, b, w):
    for p in (2, 4, 8):
        r = simulate("1f1b", p, 4 * p, fwd=f, bwd=b + w)
        assert max(r.span_idle) == pytest.approx(paper_bubble("1f1b", p, f, b, w))


def test_where_the_papers_formulas_and_the_simulation_differ():
    """At other ratios the V schedules' bubbles are not the papers' (torch's fixed orders were
    designed for equal times): pinned here, so a change shows."""
    p, m = 4, 16
    dpv = simulate("dualpipev", p, m, fwd=1.0, bwd=2.0, wgrad=1.0)
    assert max(dpv.span_idle) == pytest.approx(5.5)
    assert paper_bubble("dualpipev", p, 1.0, 2.0, 1.0) == pytest.approx(6.0)
    zbv = simulate("zbv", p, m, fwd=1.0, bwd=2.0, wgrad=1.0)
    assert max(zbv.span_idle) == pytest.approx(3.0)
    assert paper_bubble("zbv", p, 1.0, 2.0, 1.0) == pytest.approx(1.5)


def test_each_comparison_can_fail():
    """The checks above reject a wrong schedule: ZB-V with every W left to the end of its rank
    (a valid order that leaves the idle time unfilled) has neither ZB-V's bubble nor its span
    idle; DualPipeV has neither ZB-V's bubble nor its peak."""
    p, m = 4, 8
    late = [[s for s in row if s[0][0] != "W"] + [s for s in row if s[0][0] == "W"]
            for row in zbv_orders(p, m)]
    r = run_orders("zbv", late, v_place(p), {"F": 0.5, "B": 0.5, "W": 0.5}, 0.0, 3.0 * m, m)
    assert not same_bubble("zbv", p, m, r)
    assert max(r.span_idle) != pytest.approx(paper_bubble("zbv", p, 1.0, 1.0, 1.0))
    dpv = simulate("dualpipev", p, m, 1.0, 1.0, wgrad=1.0)
    assert dpv.peak_chunks != v_peak_chunks("zbv", p, m) and not same_bubble("zbv", p, m, dpv)


def test_figures_at_four_ranks_eight_microbatches():
    """The course's comparison, f = b = w = 1 (1F1B's backward b + w = 2): the bubble beyond
    the ideal m (f + b + w) = 24, and each schedule's peak micro-batches on rank 0."""
    got = {s: simulate(s, 4, 8, 1.0, 2.0 if s == "1f1b" else 1.0,
                       **({} if s == "1f1b" else {"wgrad": 1.0})) for s in
           ("1f1b", "zero-bubble", "zbv", "dualpipev")}
    assert {s: r.makespan - r.ideal for s, r in got.items()} == {
        "1f1b": 9.0, "zero-bubble": 3.0, "zbv": 1.5, "dualpipev": 3.0}
    assert {s: r.peak_in_flight[0] for s, r in got.items()} == {
        "1f1b": 4.0, "zero-bubble": 4.0, "zbv": 4.0, "dualpipev": 4.5}


@pytest.mark.parametrize("call, message", [
    (lambda: simulate("zbv", 4, 8, chunks=3), "chunks=3: zbv places 2 chunks on each rank"),
    (lambda: simulate("dualpipev", 4, 7), "microbatches=7 is fewer than the 8 stages"),
    (lambda: simulate("1f1b", 4, 8, wgrad=1.0),
     "wgrad=1.0 needs schedule='zero-bubble', 'zbv' or 'dualpipev'"),
    (lambda: bubble_formula("dualpipev", 4, 4), "m=4 is fewer than the 8 stages"),
])
def test_bad_shapes_are_messages(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_chunks_two_is_accepted_and_microbatches_for_a_target():
    assert simulate("zbv", 4, 8, chunks=2).events == simulate("zbv", 4, 8).events
    assert min_microbatches(8, 0.10, "zbv") == 12          # 7 / (6 * 12 + 7) <= 0.1
    assert min_microbatches(2, 0.5, "dualpipev") == 4      # no fewer than 2p
    share, _ = bubble_formula("zbv", 8, 11)
    assert share > 0.10
