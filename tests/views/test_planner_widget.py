"""The planner calculator, typed into as a learner would: results are labkit.planner.plan's (the
best, the ranked table, the rejections by reason, the decision ladder), the figure stacks each
layout's step time and draws memory against the GPU's capacity, nothing-fits shows the leanest
layouts over it, bad input is a message naming the field and the calculator recovers; then the
controls driven with anything (tests/views/test_calculator_properties.py)."""
from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from labkit import field
from labkit.kernels import matmul_efficiency
from labkit.planner import decide, evaluate, plan
from labkit.plots import png_bytes
from labkit.plots.planner import LABELS, layout_label
from labkit.widgets import planner as planner_widget
from labkit.widgets.planner import MAX_GPUS, MAX_TOP, PlannerCalculator, cached_plan
from test_calculator_properties import (PROPERTY, _assert_readable, _checked_png,
                                        _raises_value_error, _text, drive, type_into)

CONTROLS = ("model", "gpus", "gpu", "gpus_per_node", "global_batch", "seq_len", "mfu", "top",
            "published")


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.planner.png_bytes", _checked_png)
        yield


def _key(e):
    return e.layout, e.step_time, e.memory


def check_planner(calc: PlannerCalculator) -> None:
    """One state: a result that is plan()'s for the controls, or a message and nothing else."""
    shown = calc.result.value
    assert ("labkit-error" in shown) == (calc.error is not None), (calc.error, shown[:300])
    if calc.error is not None:
        assert calc.plan is None and calc.shown is None and calc.decision is None
        assert "labkit-verdict" not in shown and "Traceback" not in shown
        assert calc.rejections.value == "" and calc.ladder.value == ""
        assert calc.figure.value == b"" and calc.figure.layout.display == "none"
        assert _raises_value_error(lambda: plan(**calc.inputs())) or _raises_value_error(
            calc.top)
        return
    kw, k = calc.inputs(), calc.top()
    want = plan(**kw)                             # computed afresh, not from the cache
    assert [_key(e) for e in calc.plan.ranked] == [_key(e) for e in want.ranked]
    assert [(r.layout, r.reason) for r in calc.plan.rejected] == [
        (r.layout, r.reason) for r in want.rejected]
    rest = {n: v for n, v in kw.items() if n not in ("model", "gpus")}
    drawn = want.ranked[:k] or [evaluate(kw["model"], r.layout, **rest)
                                for r in want.leanest(k)]
    assert [_key(e) for e in calc.shown] == [_key(e) for e in drawn]
    assert [r.lever for r in calc.decision.rungs] == [r.lever for r in decide(want).rungs]
    assert "labkit-verdict" in shown and want.why().split(":")[0] in _text(shown)
    for kind, count in want.rejection_counts().items():
        assert f"{kind}" in _text(calc.rejections.value) and f"{count:,}" in _text(
            calc.rejections.value)
    for html in (shown, calc.rejections.value, calc.ladder.value):
        _assert_readable(_text(html), "planner")
    assert (calc.figure.layout.display != "none") == bool(drawn)
    if drawn:
        assert bytes(calc.figure.value).startswith(b"\x89PNG")


def test_defaults_are_the_planners():
    calc = PlannerCalculator()
    check_planner(calc)
    # the matmul share shown (one decimal, percent) is what labkit.kernels prices
    assert calc.controls["mfu"].value == pytest.approx(100 * matmul_efficiency("h100-sxm"),
                                                       abs=0.05)
    want = plan("llama3-70b", 64, gpu="h100-sxm", global_batch=512, seq_len=8192,
                mfu=calc.controls["mfu"].value / 100)
    assert calc.plan.best.layout == want.best.layout and len(calc.shown) == 8
    row = _text(calc.result.value)
    assert f"{want.best.step_time:,.3f}" in row and f"{want.best.memory / 1e9:,.1f}" in row
    assert f"{want.best.tokens_per_second:,.0f}" in row
    assert "tp across nodes" in _text(calc.rejections.value)
    ladder = _text(calc.ladder.value)
    assert "<td>turn on first</td>" in calc.ladder.value and "+ TP inside a node" in ladder


def test_typing_reaches_the_planner():
    calc = PlannerCalculator(model="llama2-13b", gpus=16, seq_len=4096)
    type_into(calc, gpus="1,024", gpu="a100-80gb", global_batch="2048", mfu=40, top="5")
    check_planner(calc)
    want = plan("llama2-13b", 1024, gpu="a100-80gb", global_batch=2048, seq_len=4096, mfu=0.4)
    assert [e.layout for e in calc.shown] == [e.layout for e in want.ranked[:5]]
    assert "TP on NVLink 3 (A100)" in calc.result.value and len(calc.shown) == 5


def test_changing_only_top_redraws_from_the_cached_plan():
    calc = PlannerCalculator(model="llama3-405b", gpus=16384, global_batch=2048)
    hits = cached_plan.cache_info().hits
    start = time.perf_counter()
    type_into(calc, top="3")
    assert time.perf_counter() - start < 10      # about 0.1 s with the quick figure
    assert cached_plan.cache_info().hits == hits + 1 and len(calc.shown) == 3
    assert 4 <= calc.plan.best.layout.tp <= 8 and calc.plan.best.layout.pp > 1
    check_planner(calc)


def test_nothing_fits_shows_why_and_the_leanest_layouts_over_the_capacity():
    calc = PlannerCalculator(model="llama3-405b", gpus=8, global_batch=64)
    check_planner(calc)
    shown = _text(calc.result.value)
    assert "Nothing fits" in shown and "model states alone" in shown
    assert calc.plan.ranked == [] and len(calc.shown) == 8
    assert all(not e.fits and e.memory > 10 * e.capacity for e in calc.shown)
    assert calc.decision.first is None and "<td>turn on first</td>" not in calc.ladder.value
    assert "memory" in _text(calc.rejections.value)


@pytest.mark.parametrize("values, start", [
    ({"gpus": "2.5"}, "GPUs='2.5' is not a whole number"),
    ({"gpus": "0"}, "GPUs=0 must be a whole number >= 1"),
    ({"gpus": "12"}, "GPUs=12 is not a whole number of nodes of GPUs per node=8"),
    ({"gpus": str(2 * MAX_GPUS)}, f"GPUs={2 * MAX_GPUS:,} is more than this calculator plans"),
    ({"global_batch": "abc"}, "global batch='abc' is not a whole number"),
    ({"seq_len": "-5"}, "seq length=-5 must be a whole number >= 1"),
    ({"mfu": 0.0}, "MFU (%)=0.0 must be a number >= 1 and <= 100"),
    ({"mfu": 0.5}, "MFU (%)=0.5 must be a number >= 1 and <= 100"),
    ({"top": "0"}, "top K=0 must be a whole number >= 1"),
    ({"top": str(MAX_TOP + 1)}, f"top K={MAX_TOP + 1} must be a whole number >= 1 and <= "),
    ({"model": "gpt2", "seq_len": "4096"}, "seq length=4,096 exceeds the 1,024 learned positions"),
])
def test_bad_input_is_a_message_then_recovers(values, start):
    calc = PlannerCalculator(model="llama2-7b", gpus=16, seq_len=4096, global_batch=64)
    type_into(calc, **values)
    assert calc.error is not None and calc.error.startswith(start), calc.error
    check_planner(calc)
    type_into(calc, model="llama2-7b", gpus="16", seq_len="4096", global_batch="64", mfu=50,
              top="8", gpus_per_node="8")
    assert calc.error is None                                   # and it recovers
    check_planner(calc)


def test_unknown_or_unoffered_starting_values_are_messages():
    with pytest.raises(ValueError, match="unknown control"):
        PlannerCalculator(tp=8)
    with pytest.raises(ValueError, match=r"^gpu='v100' is not offered; allowed: 'a100-40gb'"):
        PlannerCalculator(gpu="v100")


def test_the_real_figure_stacks_the_parts_and_marks_the_capacity():
    drawn = []
    saved = planner_widget.png_bytes
    planner_widget.png_bytes = lambda fig: drawn.append(fig) or png_bytes(fig, dpi=40)
    try:
        calc = PlannerCalculator(model="llama2-70b", gpus=64, seq_len=4096, top=4)
    finally:
        planner_widget.png_bytes = saved
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    fig = drawn[-1]
    steps, mem = fig.axes
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert LABELS["compute"] in labels and "GPU memory, 80 GB" in labels
    # the stacked bars of each layout add up to its step time; the memory bars are its memory
    ends = {}
    for bar in steps.patches:
        y = round(bar.get_y(), 6)
        ends[y] = max(ends.get(y, 0.0), bar.get_x() + bar.get_width())
    assert sorted(ends.values()) == pytest.approx(sorted(e.step_time for e in calc.shown))
    assert sorted(b.get_width() for b in mem.patches) == pytest.approx(
        sorted(e.memory / 1e9 for e in calc.shown))
    top = max(zip(steps.get_yticks(), (t.get_text() for t in steps.get_yticklabels())))
    assert top[1] == f"#1 {layout_label(calc.shown[0].layout)}"     # the fastest on top
    assert any(line.get_xdata()[0] == 80 for line in mem.lines)


def test_every_control_is_driven_below():
    assert sorted(PlannerCalculator().controls) == sorted(CONTROLS)


@settings(PROPERTY, max_examples=8)
@given(data=st.data())
def test_planner_calculator_shows_a_result_or_a_message(data):
    calc = PlannerCalculator(model="llama2-7b", gpus=16, seq_len=4096, global_batch=64)
    weights = dict.fromkeys(CONTROLS, 1)
    weights.update({n: 3 for n in ("gpus", "global_batch", "seq_len", "top")})
    drive(data, calc, check_planner, weights)


def test_a_published_run_is_a_starting_point():
    calc = PlannerCalculator()
    calc.controls["published"].value = "megatron 1t"
    run = field.published_runs()["megatron 1t"]
    assert calc.controls["gpus"].value == "3,072" or calc.controls["gpus"].value == "3072"
    assert calc.controls["gpu"].value == "a100-80gb" and calc.plan.inputs["gpus"] == 3072
    want = plan(run.model, 3072, gpu="a100-80gb", global_batch=3072, seq_len=2048,
                mfu=calc.controls["mfu"].value / 100)
    assert calc.comparison.rank == want.compare(run.layout).rank
    assert "Published: megatron 1t" in calc.published.value and "rank" in calc.published.value
    check_planner(calc)
    calc.controls["gpus"].value = "64"           # the layout no longer matches the cluster
    assert calc.comparison is None and "needs 3,072 GPUs" in calc.published.value
    calc.controls["published"].value = ""
    assert calc.published.value == "" and calc.comparison is None
    with pytest.raises(ValueError, match="published run"):
        calc.load_published("gpt-5")
