"""labkit.field: the measured sweep, read and priced as run, and its agreement figures.

The figures asserted are issue 31's reach (median Spearman >= 0.7 with >= 80 % of groups >= 0.5,
fits >= 85 %, median ratio 0.8-1.25 with >= 50 % within 25 %). Today (labkit.kernels: matmul
roofline at measured ceilings x SUSTAINED, FlashAttention, elementwise traffic, the framework's
host time and nanotron's cross-node pipeline wait): median Spearman 0.80 with 86 % of the 14
groups >= 0.5, fits 87.1 %, median ratio 1.02 with 64 % within 25 %. Each can fail: a shuffled
prediction, a model that fits everything, a planner twice as optimistic."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from labkit import field


@pytest.fixture(scope="module")
def rows():
    return field.price_sweep()


def test_the_sweep_is_read_whole_with_its_layouts():
    rows = field.sweep_rows()
    assert len(rows) == 1643
    assert {r.model for r in rows} == {"1B", "8B"} and {r.status for r in rows} == {"ok", "oom"}
    for r in rows:
        assert r.layout.gpus == 8 * r.nodes
    # the header's check: MFU = tok/s/GPU x 6P(+attention) / 989e12, P from the shapes
    assert field.SWEEP_MODELS["1B"].num_params() == pytest.approx(1.34e9, rel=0.01)
    assert field.SWEEP_MODELS["8B"].num_params() == pytest.approx(8.86e9, rel=0.01)


def test_spearman_is_the_rank_correlation():
    assert field.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert field.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert field.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)


def test_the_planner_agrees_with_the_sweep_at_least_as_well_as_today(rows):
    m = field.sweep_metrics(rows)
    print("\n" + m.text())
    assert m.priced >= 1580 and len(m.groups) == 14      # TP over whole nodes priced too
    assert m.median_spearman >= 0.70 and m.share_groups_at_half >= 0.80
    assert m.fits_agreement >= 0.85
    assert 0.8 <= m.median_ratio <= 1.25 and m.share_within_25 >= 0.50
    assert m.crashed == sum(bool(r.measured_tokens) and r.status != "ok" for r in rows) == 14


def test_nanotrons_pipeline_wait_is_the_one_its_host_bound_runs_measured():
    """NANOTRON_PP_TP_WAIT is read off the sweep (labkit.field.fit_pp_tp_wait), and it is what
    the planner charges: only where a pipeline hop crosses nodes with TP inside a stage."""
    from labkit.kernels import FRAMEWORKS, NANOTRON_PP_TP_WAIT
    from labkit.planner import Layout, evaluate

    assert field.fit_pp_tp_wait() == pytest.approx(NANOTRON_PP_TP_WAIT, rel=0.03)
    assert FRAMEWORKS["nanotron"].pp_tp_wait == NANOTRON_PP_TP_WAIT
    kw = dict(field.SWEEP_SETUP, global_batch=256)
    one_node, two_nodes = (evaluate(field.SWEEP_MODELS["8B"], Layout(
        tp=4, pp=pp, dp=2, micro_batch=1, sequence_parallel=True), **kw) for pp in (1, 2))
    assert one_node.breakdown["host"] < 0.1 * two_nodes.breakdown["host"]   # pp=2 spans 2 nodes
    # 128 micro-batches x 16 layers x 4 TP ranks x the wait, less what the device covers
    assert two_nodes.breakdown["host"] > 128 * 16 * 4 * NANOTRON_PP_TP_WAIT * 0.5


def test_evaluate_prices_tp_over_whole_nodes_on_the_inter_node_link():
    from labkit.planner import Layout, degree_problem, evaluate
    from labkit.models import get_model

    e = evaluate("llama2-7b", Layout(tp=16, dp=2, sequence_parallel=True), global_batch=64,
                 seq_len=4096)
    assert "NVLink" not in e.links["tp"] and e.breakdown["tp"] > 0
    assert degree_problem(get_model("llama3-8b"), Layout(tp=16), 8, 4096).startswith(
        "tp across nodes")                                   # plan() still refuses it
    with pytest.raises(ValueError, match="tp across nodes"):
        evaluate("llama3-8b", Layout(tp=12, dp=2), global_batch=64, seq_len=4096, gpus_per_node=8)


def test_the_figures_can_fail(rows):
    m = field.sweep_metrics(rows)
    rng = random.Random(0)
    priced = [r for r in rows if r.estimate is not None and r.measured_tokens]
    tokens = [r.measured_tokens for r in priced]
    rng.shuffle(tokens)
    shuffled = [replace(r, measured_tokens=t) for r, t in zip(priced, tokens)]
    assert field.sweep_metrics(shuffled).median_spearman < m.median_spearman - 0.2


@pytest.mark.parametrize("name", list(field.published_runs()))
def test_published_layouts_rank_near_the_best_of_their_era(name):
    """Issue 31: top 10, or within 10 % of the best step time, among the layouts the run's
    framework offered (labkit.planner.ERAS); where not, `compare` says why. Today: GPT-3 rank 23
    at 1.093x, 310B #12 at 1.04x, 1T #2, MT-NLG #12 at 1.086x, OPT #4, BLOOM #14 at 1.011x;
    Llama 3 405B (every lever) fits (77.8 GB of the 79.2 GB usable on an H100's 79.11 GiB), and
    the best layout, with CP = 8, is 1.42x faster, mostly by its bubble (NVIDIA's NeMo ships CP 4
    at 8K for the 405B: recipes)."""
    run = field.published_runs()[name]
    c, p = field.rank_in_plan(run.model, run.layout, run.inputs, run.era)
    slower = c.estimate.step_time / p.best.step_time
    print(f"\n{name}: rank {c.rank} of {c.of}, {slower:.3f}x the best")
    if run.era is None:                                  # Llama 3: explained, part by part
        text = c.text()
        assert "mostly bubble" in text and "does not fit" not in text and c.estimate.fits
        assert c.differences()["bubble"] > 0.5 * (c.estimate.step_time - p.best.step_time)
    else:
        assert (c.rank is not None and c.rank <= 10) or slower <= 1.12, (name, c.rank, slower)


def test_a_shipped_recipe_ranks_near_the_best():
    """NVIDIA NeMo's Llama 3 70B recipe (CP 2 at 8K tokens) and Llama 3.1 405B recipe (CP 4 at
    8K, interleaved with m = 256 on 9 stages): each within 10 % of the best (today 1.045x and
    1.056x)."""
    for name, r in field.recipes().items():
        c, p = field.rank_in_plan(r.model, r.layout, r.inputs)
        assert c.estimate.fits and c.estimate.step_time <= 1.1 * p.best.step_time, name
        assert r.layout.cp > 1 and p.best.layout.cp > 1      # CP pays here, as NeMo ships it


def test_fits_and_ratio_can_fail(rows):
    """A planner that fits everything, or one twice as optimistic, fails the guards above."""
    m = field.sweep_metrics(rows)
    roomy = [replace(r, estimate=replace(r.estimate, usable=float("inf")))
             if r.estimate is not None else r for r in rows]
    assert field.sweep_metrics(roomy).fits_agreement < 0.86 <= m.fits_agreement
    halved = [replace(r, measured_tokens=r.measured_tokens / 2) if r.measured_tokens else r
              for r in rows]
    assert field.sweep_metrics(halved).median_ratio > 1.25 >= m.median_ratio
