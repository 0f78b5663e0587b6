"""The MoE calculator, typed into as a learner would: parameters, memory (at ep and at ep=1, against
the usable memory), FLOPs per token and the expert-parallel all-to-alls all follow labkit; a
different ep changes the memory; bad input is a message naming the field, with no figure; the
calculator is a tab of the calculators app; then every control driven with anything."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from labkit.comm import collective_time, step_communication
from labkit.flops import flops_per_token
from labkit.hardware import get_gpu, get_link
from labkit.memory import estimate_memory
from labkit.models import PRESETS, get_model
from labkit.planner import usable_memory
from labkit.plots import png_bytes
from labkit.widgets.moe import MODELS, MoECalculator
from test_calculator_properties import (PROPERTY, _checked_png, _raises_value_error,
                                        _shows_one_state, _text, drive,
                                        start_or_name_the_control, type_into)

CONTROLS = ("model", "gpus_per_node", "tp", "dp", "ep", "zero_stage", "seq_len", "batch_size",
            "capacity_factor", "gpu")


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.moe.png_bytes", _checked_png)
        yield


def expected(kw: dict) -> dict:
    """What labkit says for the calculator's inputs, computed here, call by call."""
    spec = get_model(kw["model"])
    tp, ep, s, b, cf = kw["tp"], kw["ep"], kw["seq_len"], kw["batch_size"], kw["capacity_factor"]
    mem = dict(seq_len=s, batch_size=b, tp=tp, dp=kw["dp"], zero_stage=kw["zero_stage"],
               capacity_factor=cf, sequence_parallel=tp > 1)
    comm = step_communication("ep", spec, ep=ep, seq_len=s, batch_size=b, capacity_factor=cf,
                              tp=tp, sequence_parallel=tp > 1)
    link = get_link("nvlink4" if kw["gpus_per_node"] % ep == 0 else "ib-ndr")
    return dict(memory=estimate_memory(spec, ep=ep, **mem),
                dense=estimate_memory(spec, ep=1, **mem), comm=comm, link=link,
                time=sum(c.count * collective_time("all_to_all", c.nbytes, ep, link.bandwidth,
                                                   link.latency) for c in comm.collectives))


def check_moe(calc: MoECalculator) -> None:
    _shows_one_state(calc.result.value, calc.figure, calc.error)
    if calc.error is None:
        kw = calc.inputs()
        want = expected(kw)
        assert calc.memory == want["memory"] and calc.dense_memory == want["dense"]
        assert calc.comm.by_op == want["comm"].by_op
        assert calc.sweep[kw["ep"]] == want["memory"] and calc.sweep[1] == want["dense"]
        assert calc.usable == usable_memory(get_gpu(kw["gpu"]).device_bytes)
    else:
        assert calc.memory is None and calc.sweep is None and calc.comm is None
        assert _raises_value_error(lambda: [calc.inputs(), expected(calc.inputs())])


def test_the_models_offered_are_the_moe_presets():
    assert MODELS == [k for k, s in PRESETS.items() if s.is_moe]
    assert {"mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "debug-moe"} <= set(MODELS)
    assert sorted(MoECalculator().controls) == sorted(CONTROLS)


def test_defaults_show_the_numbers_labkit_computes():
    calc = MoECalculator()
    check_moe(calc)
    kw = calc.inputs()
    assert (kw["model"], kw["gpus_per_node"], kw["capacity_factor"], kw["gpu"]) == \
        ("mixtral-8x7b", 8, None, "h100-sxm")
    spec, want = get_model("mixtral-8x7b"), expected(kw)
    assert calc.params == {"total": spec.num_params(), "active": spec.active_params(),
                           "experts": spec.param_breakdown()["experts"]}
    assert calc.flops == flops_per_token(spec, kw["seq_len"])
    assert calc.dense_flops == 6 * spec.num_params()
    assert calc.link == get_link("nvlink4") and calc.comm_time == pytest.approx(want["time"])
    assert calc.capacity == get_gpu("h100-sxm").memory
    shown = _text(calc.result.value)
    for k in ("params", "grads", "optimizer_states", "activations", "total"):
        assert f"{getattr(want['memory'], k) / 1e9:,.2f}" in shown, k
        assert f"{getattr(want['dense'], k) / 1e9:,.2f}" in shown, k
    (op, (count, sent)), = want["comm"].by_op.items()
    assert op == "all_to_all" and f"{count:,} all-to-all" in shown
    assert f"{sent / 1e9:,.3f} GB" in shown and "NVLink 4" in shown
    assert f"{usable_memory(get_gpu('h100-sxm').device_bytes) / 1e9:,.2f} GB" in shown
    assert f"{spec.active_params() / spec.num_params():.1%}" in shown
    assert list(calc.sweep) == [1, 2, 4, 8]


def test_changing_ep_changes_the_memory_and_the_traffic():
    calc = MoECalculator()
    at_8 = calc.memory
    before = calc.result.value
    type_into(calc, ep="2")
    check_moe(calc)
    assert calc.memory.total > at_8.total and calc.memory.params > at_8.params
    assert calc.result.value != before and calc.sweep[2] == calc.memory
    assert calc.dense_memory.total > calc.memory.total
    type_into(calc, ep="1")
    check_moe(calc)
    assert calc.memory == calc.dense_memory and "none (ep=1" in _text(calc.result.value)
    assert calc.comm_time == 0


def test_an_ep_group_wider_than_a_node_goes_over_infiniband():
    calc = MoECalculator(model="deepseek-v3", tp=8, dp=32, ep=32)
    check_moe(calc)
    assert calc.link == get_link("ib-ndr") and "across nodes" in _text(calc.result.value)
    assert max(calc.sweep) == 256


def test_typing_reaches_the_cost_models():
    calc = MoECalculator()
    type_into(calc, model="qwen3-30b-a3b", tp="1", dp="16", ep="16", zero_stage=3,
              seq_len="2,048", batch_size="2", capacity_factor="1.25", gpu="h200",
              gpus_per_node="16")
    check_moe(calc)
    kw = calc.inputs()
    assert (kw["ep"], kw["seq_len"], kw["capacity_factor"]) == (16, 2048, 1.25)
    assert calc.link == get_link("nvlink4") and calc.capacity == get_gpu("h200").memory
    type_into(calc, capacity_factor="")
    check_moe(calc)
    assert calc.inputs()["capacity_factor"] is None


@pytest.mark.parametrize("values, start", [
    ({"ep": "3"}, "ep=3 does not divide num_experts=8"),
    ({"ep": "16"}, "ep=16 does not divide num_experts=8"),
    ({"dp": "2"}, "ep x etp = 8 x 1 must divide tp x dp = 2 x 2"),
    ({"ep": "2.5"}, "ep='2.5' is not a whole number"),
    ({"ep": "0"}, "ep=0 must be a whole number >= 1"),
    ({"capacity_factor": "lots"}, "capacity factor='lots' is not a number"),
    ({"capacity_factor": "0"}, "capacity factor=0.0 must be a number >= 0.001"),
    ({"gpus_per_node": "0"}, "GPUs/node=0 must be a whole number >= 1"),
    ({"batch_size": "abc"}, "micro-batch='abc' is not a whole number"),
])
def test_bad_input_is_a_message_and_no_figure(values, start):
    calc = MoECalculator()
    type_into(calc, **values)
    assert calc.error is not None and calc.error.startswith(start), calc.error
    assert "labkit-error" in calc.result.value and "Traceback" not in calc.result.value
    assert calc.figure.layout.display == "none" and calc.figure.value == b""
    check_moe(calc)
    type_into(calc, ep="8", dp="16", capacity_factor="", gpus_per_node="8", batch_size="1")
    assert calc.error is None and calc.figure.layout.display != "none"      # and it recovers
    check_moe(calc)


def test_unknown_or_unoffered_starting_values_are_messages():
    with pytest.raises(ValueError, match="unknown control"):
        MoECalculator(pp=2)
    with pytest.raises(ValueError, match=r"^model='llama2-7b' is not offered"):
        MoECalculator(model="llama2-7b")


def test_the_real_figure_has_a_bar_per_ep_and_the_usable_line():
    import labkit.widgets.moe as moe
    drawn = []
    moe.png_bytes, saved = (lambda fig: drawn.append(fig) or png_bytes(fig, dpi=40)), moe.png_bytes
    try:
        calc = MoECalculator()
    finally:
        moe.png_bytes = saved
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    ax = drawn[-1].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(x.startswith(f"usable: {calc.usable / 1e9:,.1f} GB") for x in labels)
    assert [t.get_text() for t in ax.texts] == [f"{calc.memory.total / 1e9:,.1f}"]


def test_the_calculator_is_a_tab_of_the_app():
    from labkit.app import CALCULATORS, KEYS, CalculatorsApp

    entry = CALCULATORS[KEYS.index("moe")]
    assert (entry.module, entry.cls, entry.title) == ("moe", "MoECalculator", "MoE")
    app = CalculatorsApp(selected="moe")
    calc = app.built["moe"]
    assert isinstance(calc, MoECalculator) and calc.widget in app.pages["moe"].children
    assert app.tabs.titles[KEYS.index("moe")] == "MoE"


FEWER = settings(PROPERTY, max_examples=25)


@FEWER
@given(data=st.data())
def test_moe_calculator_shows_a_result_or_a_message(data):
    start = data.draw(st.sampled_from([{}, {"model": "debug-moe", "seq_len": 256},
                                       {"model": "deepseek-v3", "dp": 32, "ep": 32}]))
    calc = MoECalculator(**start)
    weights = dict.fromkeys(CONTROLS, 1)
    weights.update({n: 3 for n in ("tp", "dp", "ep", "seq_len", "capacity_factor")})
    drive(data, calc, check_moe, weights)


@FEWER
@given(data=st.data())
def test_a_starting_value_gives_a_calculator_or_a_message_naming_the_control(data):
    start_or_name_the_control(data, MoECalculator, CONTROLS, check_moe)
