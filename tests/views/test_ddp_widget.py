"""The DDP step-time calculator and its figure, driven from plain pytest (no kernel): set control
values as a learner would; results follow labkit.scaling; bad input is a message. The last part
drives every control with anything a learner or a notebook cell may give it (the properties of
tests/views/test_calculator_properties.py, applied to this calculator)."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
import ipywidgets as widgets
import pytest

from labkit.flops import flops_per_step
from labkit.hardware import GPUS, LINKS
from labkit.memory import estimate_memory
from labkit.models import get_model
from labkit.plots import png_bytes
from labkit.plots.ddp import scaling_figure
from labkit.scaling import ddp_step_time, scaling_curve
from labkit.widgets.comm import _fmt_time
from labkit.widgets.ddp import CUSTOM, DDPCalculator
from test_calculator_properties import type_into as _set
from test_calculator_properties import (PROPERTY, _checked_png, _raises_value_error,
                                        _shows_one_state, drive, start_or_name_the_control)


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    """A checked stand-in for png_bytes (a real render takes ~0.5 s); tests that request
    `real_png` render the real figure."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.ddp.png_bytes", _checked_png)
        yield


@pytest.fixture
def real_png(monkeypatch):
    monkeypatch.setattr("labkit.widgets.ddp.png_bytes", png_bytes)



def check_ddp(calc: DDPCalculator) -> None:
    _shows_one_state(calc.result.value, calc.figure, calc.error)
    if calc.error is None:           # the result is the one the controls ask for, not stale
        kw = calc.inputs()
        assert calc.step == ddp_step_time(**kw)
        assert math.isfinite(calc.step.total) and calc.step.total > 0
        assert calc.step.gpus in calc.curve.gpus
        assert calc.memory.total == estimate_memory(**calc.memory_inputs(kw)).total
        assert calc.fits == (calc.memory.total <= GPUS[calc.controls["gpu"].value].memory)
        assert ("Does not fit" in calc.result.value) == (not calc.fits)
    else:
        assert calc.step is None and calc.curve is None and calc.memory is None
        assert _raises_value_error(lambda: ddp_step_time(**calc.inputs())) or \
            _raises_value_error(lambda: estimate_memory(**calc.memory_inputs(calc.inputs())))


@pytest.mark.usefixtures("real_png")
def test_defaults_follow_ddp_step_time():
    calc = DDPCalculator()
    want = ddp_step_time("llama2-7b", 8, "ib-ndr", compute_seconds=0.5)
    assert calc.error is None and calc.step == want
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    text = calc.result.value
    for shown in (_fmt_time(want.total), _fmt_time(want.exposed), _fmt_time(want.communication),
                  f"{want.ratio:,.2f}", f"{want.buckets:,} of 26.21 MB (25.00 MiB)"):
        assert shown in text, shown
    assert calc.curve.stops_scaling == 2 and "stops scaling at <b>2 GPUs</b>" in text


@pytest.mark.usefixtures("real_png")
def test_controls_change_result_and_plot():
    calc = DDPCalculator()
    before = (calc.result.value, bytes(calc.figure.value))
    _set(calc, gpus=64)
    assert calc.step == ddp_step_time("llama2-7b", 64, "ib-ndr", compute_seconds=0.5)
    assert calc.result.value != before[0] and bytes(calc.figure.value) != before[1]


@pytest.mark.parametrize("name, value, want", [
    ("link", "nvlink4", dict(link="nvlink4")),
    ("algorithm", "tree", dict(algorithm="tree")),
    ("grad_dtype", "bf16", dict(grad_bytes="bf16")),
    ("bucket_mb", 100.0, dict(bucket_size_mb=100.0)),
    ("overlap", 0.0, dict(overlap=0.0)),
    ("compute_ms", 2000.0, dict(compute_seconds=2.0)),
    ("model", "gpt2", dict(model="gpt2")),
])
def test_each_control_reaches_the_cost_model(name, value, want):
    calc = DDPCalculator()
    _set(calc, **{name: value})
    kw = {"model": "llama2-7b", "gpus": 8, "link": "ib-ndr", "compute_seconds": 0.5, **want}
    assert calc.error is None and calc.step == ddp_step_time(**kw)


def test_custom_model_and_link():
    calc = DDPCalculator(model=CUSTOM, params_b=1.5, link=CUSTOM, bandwidth_gbs=12.5,
                         latency_us=10.0, gpus=16)
    want = ddp_step_time(1.5e9, 16, None, bandwidth=12.5e9, latency=1e-5, compute_seconds=0.5)
    assert calc.error is None and calc.step.gradient_bytes == 6e9
    for name in ("communication", "exposed", "total", "latency_time"):
        assert getattr(calc.step, name) == pytest.approx(getattr(want, name), rel=1e-12), name


def test_compute_from_flops():
    calc = DDPCalculator(model="gpt2", compute="flops", gpu="a100-80gb", mfu=50, batch_size=8,
                         seq_len=1024)
    peak = GPUS["a100-80gb"].peak_flops["bf16"]
    assert calc.step.compute == pytest.approx(flops_per_step("gpt2", 8, 1024) / (0.5 * peak))
    assert calc._by_flops.layout.display == "" and calc._by_time.layout.display == "none"


def test_a_model_that_does_not_fit_says_so():
    """llama3-405b under DDP on 64 GPUs was priced (a step time, a curve) without a word about
    the 1.6 TB of fp32 gradients each GPU would hold."""
    calc = DDPCalculator(model="llama3-405b", gpus=64)
    check_ddp(calc)
    assert calc.fits is False and "Does not fit" in calc.result.value
    assert calc.memory.grads == pytest.approx(4 * get_model("llama3-405b").num_params())
    assert "ZeRO or FSDP" in calc.result.value
    _set(calc, model="gpt2")
    assert calc.fits is True and "Fits" in calc.result.value and "Does not fit" not in \
        calc.result.value
    _set(calc, gpu="t4", grad_dtype="bf16", model="llama2-7b")       # 16 GB; 108 GB of states
    assert calc.fits is False
    assert f"Does not fit</b> on one {GPUS['t4'].name}" in calc.result.value


def test_the_memory_verdict_counts_activations_only_of_sequences_it_is_given():
    calc = DDPCalculator(model="llama2-7b", compute="flops", batch_size=4, seq_len=4096)
    check_ddp(calc)
    assert calc.memory.activations > 0 and "activations of 4 sequence(s)" in calc.result.value
    _set(calc, compute="time")
    assert calc.memory.activations == 0 and "activations not counted" in calc.result.value


def test_mfu_is_typed_in_percent():
    calc = DDPCalculator(model="gpt2", compute="flops", gpu="a100-80gb", batch_size=8,
                         seq_len=1024)
    _set(calc, mfu=25.0)
    peak = GPUS["a100-80gb"].peak_flops["bf16"]
    assert calc.controls["mfu"].description == "MFU (%)"
    assert calc.step.compute == pytest.approx(flops_per_step("gpt2", 8, 1024) / (0.25 * peak))


@pytest.mark.parametrize("scaling", ["weak", "strong"])
def test_the_chosen_step_is_a_point_of_the_curve(scaling):
    calc = DDPCalculator(gpus=24, scaling=scaling, max_gpus=64, link="nvlink4")
    assert calc.curve.gpus == [1, 2, 4, 8, 16, 24, 32, 64]
    point = calc.curve.points[calc.curve.gpus.index(24)]
    assert point.step.total == pytest.approx(calc.step.total, rel=1e-12)
    assert point.throughput == pytest.approx(24 / calc.step.total)
    want = scaling_curve("llama2-7b", [1, 2, 4, 8, 16, 24, 32, 64], "nvlink4", scaling=scaling,
                         compute_seconds=0.5 * (24 if scaling == "strong" else 1),
                         batch=24 if scaling == "strong" else 1)
    assert [p.efficiency for p in calc.curve.points] == pytest.approx(
        [p.efficiency for p in want.points])


@pytest.mark.parametrize("values, start", [
    ({"gpus": 1}, "GPUs=1: one GPU has nothing to all-reduce"),
    ({"gpus": "2.5"}, "GPUs='2.5' is not a whole number"),
    ({"gpus": 10**8}, "GPUs=100000000 must be a whole number >= 1 and <= 1e7"),
    ({"bucket_mb": 0.0}, "bucket size (MiB)=0.0 must be a number >= 0.001"),
    ({"compute_ms": -1.0}, "compute per step (ms)=-1.0 must be a number >= 0.001"),
    ({"compute_ms": float("inf")}, "compute per step (ms)=inf"),
    ({"model": CUSTOM, "params_b": float("nan")}, "custom size (billion parameters)=nan"),
    ({"link": CUSTOM, "bandwidth_gbs": 0.0}, "custom bandwidth (GB/s per direction)=0.0"),
    ({"link": CUSTOM, "latency_us": -2.0}, "custom latency (µs)=-2.0"),
    ({"compute": "flops", "seq_len": "0"}, "seq length=0 must be a whole number >= 1"),
    ({"compute": "flops", "batch_size": "x"}, "sequences/GPU='x' is not a whole number"),
    ({"compute": "flops", "batch_size": "0"}, "sequences/GPU=0 must be a whole number >= 1"),
    ({"compute": "flops", "mfu": 0.4}, "MFU (%)=0.4 must be a number >= 1 and <= 100"),
    ({"compute": "flops", "model": "gpt2", "seq_len": "4096"}, "seq length=4096 exceeds"),
    ({"compute": "flops", "gpu": "t4"}, "dtype='bf16' is not supported; allowed: 'fp32', 'fp16'"),
])
def test_bad_input_is_a_message(values, start):
    calc = DDPCalculator(**values)
    assert calc.step is None and calc.error.startswith(start), calc.error
    check_ddp(calc)


def test_recovers_after_bad_input():
    calc = DDPCalculator()
    _set(calc, gpus=0)
    check_ddp(calc)
    assert calc.error is not None
    _set(calc, gpus=4)
    check_ddp(calc)
    assert calc.error is None and calc.figure.layout.display != "none"


def test_unknown_or_unoffered_starting_values_are_messages():
    with pytest.raises(ValueError, match="unknown control"):
        DDPCalculator(gpu_count=3)
    with pytest.raises(ValueError, match=r"^overlap=0\.33 is not offered; allowed: 0\.0, 0\.1"):
        DDPCalculator(overlap=0.33)
    with pytest.raises(ValueError, match=r"^bucket_mb='big' is not a float; allowed: a number"):
        DDPCalculator(bucket_mb="big")


@pytest.mark.parametrize("curve", [
    scaling_curve("llama3-405b", 10**7, "eth-100g", compute_seconds=1e7, scaling="strong"),
    scaling_curve(1e3, [1], None, bandwidth=1e15, latency=0.0, compute_seconds=1e-6),
    scaling_curve("gpt2", [2, 3], "nvlink5", compute_seconds=0.1),
])
def test_the_figure_at_the_extremes_is_a_png_of_finite_data(curve):
    fig = scaling_figure(curve, mark=curve.gpus[-1], title="extreme")
    _checked_png(fig)
    assert png_bytes(fig, dpi=30).startswith(b"\x89PNG")


# ---- anything a learner or a cell may give ---------------------------------------------------
# Fewer examples than for the other calculators: each change redraws a two-panel figure.
FEWER = settings(PROPERTY, max_examples=30)
CONTROLS = ("model", "params_b", "gpus", "max_gpus", "scaling", "link", "bandwidth_gbs",
            "latency_us", "algorithm", "grad_dtype", "bucket_mb", "overlap", "compute",
            "compute_ms", "gpu", "mfu", "batch_size", "seq_len")


def test_every_control_is_driven_below():
    assert sorted(DDPCalculator().controls) == sorted(CONTROLS)


@FEWER
@given(data=st.data())
def test_ddp_calculator_shows_a_result_or_a_message(data):
    start = data.draw(st.sampled_from([{}, {"model": CUSTOM}, {"link": CUSTOM},
                                       {"compute": "flops"}]))
    calc = DDPCalculator(**start)
    weights = dict.fromkeys(CONTROLS, 1)
    weights.update({n: 3 for n in ("gpus", "params_b", "bucket_mb", "compute_ms",
                                   "bandwidth_gbs", "latency_us", "batch_size", "seq_len")})
    drive(data, calc, check_ddp, weights)


@FEWER
@given(data=st.data())
def test_a_starting_value_gives_a_calculator_or_a_message_naming_the_control(data):
    start_or_name_the_control(data, DDPCalculator, CONTROLS, check_ddp)
