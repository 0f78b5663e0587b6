"""The TP calculator, typed into as a learner would: results follow labkit.tp, the figure has
the chosen link and NVLink and InfiniBand with their crossings, bad input is a message naming
the field; then every control driven with anything (tests/views/test_calculator_properties.py)."""
from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from labkit.plots import png_bytes
from labkit.tp import first_crossing, tp_cost, tp_sweep
from labkit.widgets.tp import TPCalculator
from test_calculator_properties import (PROPERTY, _checked_png, _raises_value_error,
                                        _shows_one_state, _text, drive,
                                        start_or_name_the_control, type_into)

CONTROLS = ("model", "tp", "batch_size", "seq_len", "precision", "sequence_parallel", "link",
            "gpu", "mfu")


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.tp.png_bytes", _checked_png)
        yield


def check_tp(calc: TPCalculator) -> None:
    _shows_one_state(calc.result.value, calc.figure, calc.error)
    if calc.error is None:
        kw = calc.inputs()
        want = tp_cost(**kw)
        assert (calc.cost.comm_time, calc.cost.compute_time) == (want.comm_time,
                                                                 want.compute_time)
        assert calc.cost.memory.total == want.memory.total
        assert {"nvlink4", "ib-ndr", kw["link"]} == set(calc.sweeps)
        assert calc.crossings == {k: first_crossing(v) for k, v in calc.sweeps.items()}
        assert calc.fits == (want.memory.total <= want.gpu.memory)
        assert ("Does not fit" in calc.result.value) == (not calc.fits)
    else:
        assert calc.cost is None and calc.sweeps is None and calc.crossings is None
        assert _raises_value_error(lambda: [tp_cost(**calc.inputs())])


def test_defaults_follow_the_cost_model():
    calc = TPCalculator()
    check_tp(calc)
    want = tp_cost("llama2-7b", 8, link="nvlink4", gpu="h100-sxm", mfu=0.5, seq_len=4096)
    assert calc.cost.comm_time == want.comm_time and calc.cost.ratio == want.ratio
    shown = _text(calc.result.value)
    assert f"{100 * want.efficiency_no_overlap:,.1f} % without overlap" in shown
    assert f"{want.memory.params / 1e9:,.3f} GB" in shown
    assert calc.sweeps["ib-ndr"] == tp_sweep("llama2-7b", link="ib-ndr", seq_len=4096)


def test_typing_reaches_the_cost_model():
    calc = TPCalculator()
    type_into(calc, tp="4", batch_size="2", seq_len="2,048", link="ib-ndr", mfu=40,
              sequence_parallel=True, model="llama2-13b", precision="fp16-mixed", gpu="a100-80gb")
    check_tp(calc)
    want = tp_cost("llama2-13b", 4, link="ib-ndr", gpu="a100-80gb", mfu=0.4, batch_size=2,
                   seq_len=2048, precision="fp16-mixed", sequence_parallel=True)
    assert calc.cost.comm.by_op == want.comm.by_op and calc.cost.flops == want.flops
    assert "all-gather" in calc.result.value and "reduce-scatter" in calc.result.value
    assert set(calc.sweeps) == {"ib-ndr", "nvlink4"}             # the chosen link is one of them


def test_infiniband_crosses_inside_the_node_and_nvlink_does_not():
    calc = TPCalculator(link="pcie4")
    assert set(calc.sweeps) == {"pcie4", "nvlink4", "ib-ndr"}
    assert calc.crossings["ib-ndr"] <= 8 and (calc.crossings["nvlink4"] or 99) > 8
    shown = _text(calc.result.value)
    assert f"InfiniBand NDR (1 port): tp={calc.crossings['ib-ndr']}" in shown


def test_a_rank_that_does_not_fit_says_so():
    calc = TPCalculator()                        # Llama-2-7B over 8 ranks: 14 GB of states
    check_tp(calc)
    assert calc.fits is True and "Fits" in _text(calc.result.value)
    type_into(calc, model="llama3-405b")         # 405B over 8 ranks: about 0.8 TB of states
    check_tp(calc)
    assert calc.fits is False and "Does not fit" in _text(calc.result.value)


def test_mfu_is_typed_in_percent():
    calc = TPCalculator(mfu=25)
    want = tp_cost("llama2-7b", 8, link="nvlink4", gpu="h100-sxm", mfu=0.25, seq_len=4096)
    assert calc.controls["mfu"].description == "MFU (%)"
    assert calc.cost.compute_time == want.compute_time


def test_tp_beyond_a_node_on_nvlink_is_said():
    calc = TPCalculator(tp=16)
    assert calc.cost.leaves_node and "cannot connect a group larger than one node" in \
        _text(calc.result.value)
    type_into(calc, link="ib-ndr")
    assert "cannot connect" not in calc.result.value


@pytest.mark.parametrize("values, start", [
    ({"tp": "2.5"}, "tp='2.5' is not a whole number"),
    ({"tp": "3"}, "tp=3 does not split llama2-7b"),
    ({"tp": "0"}, "tp=0 must be a whole number >= 1"),
    ({"seq_len": "100", "sequence_parallel": True}, "tp=8 does not divide seq length=100"),
    ({"mfu": 0.0}, "MFU (%)=0.0 must be a number >= 1 and <= 100"),
    ({"mfu": 0.5}, "MFU (%)=0.5 must be a number >= 1 and <= 100"),
    ({"gpu": "t4"}, "precision='bf16-mixed' runs its matmuls in bf16"),
    ({"model": "gpt2", "tp": "4"}, "seq length=4096 exceeds the 1024 learned positions of gpt2"),
    ({"batch_size": "abc"}, "micro-batch='abc' is not a whole number"),
    ({"batch_size": "0"}, "micro-batch=0 must be a whole number >= 1"),
])
def test_bad_input_is_a_message(values, start):
    calc = TPCalculator()
    type_into(calc, **values)
    assert calc.error is not None and calc.error.startswith(start), calc.error
    check_tp(calc)
    type_into(calc, model="llama2-7b", tp="8", seq_len="4096", mfu=50, gpu="h100-sxm",
              batch_size="1")
    assert calc.error is None                                   # and it recovers
    check_tp(calc)


def test_unknown_or_unoffered_starting_values_are_messages():
    with pytest.raises(ValueError, match="unknown control"):
        TPCalculator(dp=8)
    with pytest.raises(ValueError, match=r"^link='nvlink9' is not offered; allowed: 'nvlink3'"):
        TPCalculator(link="nvlink9")


def test_the_real_figure_renders_with_both_links_and_the_crossings():
    import labkit.widgets.tp as tp
    drawn = []
    tp.png_bytes, saved = (lambda fig: drawn.append(fig) or png_bytes(fig, dpi=40)), tp.png_bytes
    try:
        calc = TPCalculator(link="ib-ndr")
    finally:
        tp.png_bytes = saved
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    time_axes = drawn[-1].axes[0]
    labels = [t.get_text() for t in time_axes.get_legend().get_texts()]
    assert "compute" in labels and any("NVLink 4" in x for x in labels)
    assert any("InfiniBand NDR" in x for x in labels)
    marks = [t.get_text() for t in time_axes.texts]
    assert f"tp={calc.crossings['ib-ndr']}" in marks


def test_every_control_is_driven_below():
    assert sorted(TPCalculator().controls) == sorted(CONTROLS)


FEWER = settings(PROPERTY, max_examples=25)


@FEWER
@given(data=st.data())
def test_tp_calculator_shows_a_result_or_a_message(data):
    start = data.draw(st.sampled_from([{}, {"link": "ib-ndr"}, {"sequence_parallel": True},
                                       {"model": "gpt2", "seq_len": 1024}]))
    calc = TPCalculator(**start)
    weights = dict.fromkeys(CONTROLS, 1)
    weights.update({n: 3 for n in ("tp", "batch_size", "seq_len", "mfu")})
    drive(data, calc, check_tp, weights)


@FEWER
@given(data=st.data())
def test_a_starting_value_gives_a_calculator_or_a_message_naming_the_control(data):
    start_or_name_the_control(data, TPCalculator, CONTROLS, check_tp)


def test_no_number_in_the_result_is_unreadable():
    calc = TPCalculator(batch_size=1000, seq_len=10**6, tp=32)
    check_tp(calc)
    assert not re.search(r"\d{25}", calc.result.value)
