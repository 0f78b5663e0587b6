"""The ZeRO calculator, driven from plain pytest (no kernel): set control values as a learner
would; results follow estimate_memory, step_communication and offload_cost; bad input is a
message; then every control driven with anything (tests/views/test_calculator_properties.py)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import ipywidgets as widgets
import pytest

from labkit.comm import step_communication
from labkit.memory import estimate_memory
from labkit.offload import offload_cost
from labkit.plots import png_bytes
from labkit.widgets.zero import CUSTOM, STRATEGY, ZeROCalculator
from test_calculator_properties import type_into as _set
from test_calculator_properties import (PROPERTY, _checked_png, _raises_value_error,
                                        _shows_one_state, drive, start_or_name_the_control)


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.zero.png_bytes", _checked_png)
        yield



def check_zero(calc: ZeROCalculator) -> None:
    _shows_one_state(calc.result.value, calc.figure, calc.error)
    assert (calc.comm_figure.value == b"") == (calc.error is not None)
    if calc.error is None:
        kw = calc.inputs()
        for z, est in calc.estimates.items():
            assert est.total == estimate_memory(**kw, zero_stage=z).total
        assert set(calc.estimates) == set(calc.stages()) and calc.estimates
        assert calc.comms == calc.communication(kw)
    else:
        assert calc.estimates is None and calc.comms is None
        assert _raises_value_error(lambda: [estimate_memory(**calc.inputs(), zero_stage=z)
                                            for z in calc.stages()] + [
            calc.communication(calc.inputs())] + [
            offload_cost(1e9, calc.controls["offload"].value, zero_stage=3, compute_seconds=
                         calc._number("compute_ms") * 1e-3)
            for _ in ([] if calc.controls["offload"].value == "none" else [0])])


def test_seven_billion_on_four_gpus():
    """The issue's pitfall: "7B on 4 GPUs ZeRO-1/2/3 = 84/42/31.5/21 GB" is wrong; with
    mixed-precision Adam (2 + 2 + 12 bytes per parameter) it is 112/49/38.5/28 GB."""
    calc = ZeROCalculator(model=CUSTOM, params_b=7, dp=4)
    per_param = {0: 2 + 2 + 12, 1: 2 + 2 + 12 / 4, 2: 2 + (2 + 12) / 4, 3: 16 / 4}
    assert {z: e.total for z, e in calc.estimates.items()} == \
        pytest.approx({z: 7e9 * b for z, b in per_param.items()})
    for shown in ("112.00", "49.00", "38.50", "28.00"):
        assert shown in calc.result.value
    # ZeRO-1/2 send what DDP sends (reduce-scatter + all-gather = one all-reduce); ZeRO-3 1.5x
    ddp = 2 * (4 - 1) / 4 * 7e9 * 2
    sent = {s: c.total_bytes for s, c in calc.comms.items()}
    assert sent == pytest.approx({"ddp": ddp, "zero1": ddp, "zero2": ddp, "zero3": 1.5 * ddp})
    assert "ZeRO-3 1.50x" in calc.result.value


def test_defaults_follow_the_cost_models():
    calc = ZeROCalculator()
    assert calc.error is None and set(calc.estimates) == {0, 1, 2, 3}
    want = estimate_memory("llama2-7b", batch_size=1, seq_len=4096, dp=8, zero_stage=3)
    assert calc.estimates[3].total == want.total
    assert calc.comms["zero3"] == step_communication("zero3", model="llama2-7b", dp=8,
                                                     param_bytes=2, grad_bytes=2)
    assert calc.offload == {} and calc._host.layout.display == "none"


def test_each_control_reaches_the_cost_models():
    calc = ZeROCalculator(model=CUSTOM, params_b=1.3)
    before = calc.result.value
    _set(calc, dp=16, microbatches=4, precision="fp32")
    assert calc.estimates[1].total == estimate_memory(1.3e9, dp=16, zero_stage=1,
                                                      precision="fp32").total
    assert calc.comms["zero2"] == step_communication("zero2", num_params=1.3e9, dp=16,
                                                     microbatches=4, param_bytes=4, grad_bytes=4)
    assert calc.result.value != before
    _set(calc, link="nvlink4")
    assert "NVLink 4" in calc.result.value


@pytest.mark.parametrize("offload, stages, needs", [("optimizer", {1, 2, 3}, "needs ZeRO >= 1"),
                                                    ("params", {3}, "needs ZeRO-3")])
def test_offload_keeps_the_stages_that_can_take_it(offload, stages, needs):
    calc = ZeROCalculator(model=CUSTOM, params_b=7, dp=8, offload=offload, host_link="pcie4",
                          compute_ms=200)
    assert set(calc.estimates) == stages and set(calc.offload) == stages
    assert needs in calc.result.value and calc._host.layout.display == ""
    for z in stages:
        assert calc.estimates[z].host_bytes > 0
        assert calc.offload[z] == offload_cost(7e9, offload, zero_stage=z, dp=8, link="pcie4",
                                               compute_seconds=0.2)
    assert set(STRATEGY.values()) == set(calc.comms)     # communication still shown for all


@pytest.mark.parametrize("values, start", [
    ({"dp": "2.5"}, "dp (GPUs)='2.5' is not a whole number"),
    ({"dp": "0"}, "dp (GPUs)=0 must be a whole number >= 1"),
    ({"model": CUSTOM, "params_b": 0.0}, "custom size (billion parameters)=0.0 must be"),
    ({"model": "gpt2"}, "seq_len=4096 exceeds the 1024 learned positions of gpt2"),
    ({"offload": "optimizer", "compute_ms": 0.0}, "compute per step (ms)=0.0 must be"),
])
def test_bad_input_is_a_message(values, start):
    calc = ZeROCalculator(**values)
    assert calc.estimates is None and calc.error.startswith(start), calc.error
    check_zero(calc)
    _set(calc, model="llama2-7b", dp=4, compute_ms=100.0)     # and it recovers
    assert calc.error is None
    check_zero(calc)


def test_unknown_or_unoffered_starting_values_are_messages():
    with pytest.raises(ValueError, match="unknown control"):
        ZeROCalculator(stage=3)
    with pytest.raises(ValueError, match=r"^offload='disk' is not offered; allowed: 'none'"):
        ZeROCalculator(offload="disk")


def test_the_real_figures_render():
    import labkit.widgets.zero as zero
    zero.png_bytes, saved = png_bytes, zero.png_bytes
    try:
        calc = ZeROCalculator(offload="optimizer")
    finally:
        zero.png_bytes = saved
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    assert bytes(calc.comm_figure.value).startswith(b"\x89PNG")


FEWER = settings(PROPERTY, max_examples=25)
CONTROLS = ("model", "params_b", "dp", "microbatches", "batch_size", "seq_len", "precision",
            "optimizer", "offload", "gpu", "link", "host_link", "compute_ms")


def test_every_control_is_driven_below():
    assert sorted(ZeROCalculator().controls) == sorted(CONTROLS)


@FEWER
@given(data=st.data())
def test_zero_calculator_shows_a_result_or_a_message(data):
    start = data.draw(st.sampled_from([{}, {"model": CUSTOM}, {"offload": "optimizer"},
                                       {"model": "gpt2", "seq_len": 1024}]))
    calc = ZeROCalculator(**start)
    weights = dict.fromkeys(CONTROLS, 1)
    weights.update({n: 3 for n in ("dp", "params_b", "microbatches", "batch_size",
                                   "compute_ms")})
    drive(data, calc, check_zero, weights)


@FEWER
@given(data=st.data())
def test_a_starting_value_gives_a_calculator_or_a_message_naming_the_control(data):
    start_or_name_the_control(data, ZeROCalculator, CONTROLS, check_zero)
