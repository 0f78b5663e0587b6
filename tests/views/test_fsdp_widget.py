"""The FSDP and checkpoint calculators, typed into as a learner would: results follow
labkit.fsdp and labkit.resilience, bad input is a message naming the field, never a traceback."""
from __future__ import annotations

import pytest

from labkit.fsdp import fsdp_communication, fsdp_memory
from labkit.resilience import job_mtbf
from labkit.widgets.fsdp import CheckpointCalculator, FSDPCalculator
from test_calculator_properties import _checked_png, _shows_one_state
from test_calculator_properties import type_into


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.fsdp.png_bytes", _checked_png)
        yield


def test_fsdp_calculator_follows_the_cost_model():
    calc = FSDPCalculator(model="debug-llama", dp=4, param_dtype="fp32", reduce_dtype="same")
    assert calc.memory.total == fsdp_memory("debug-llama", 4).total
    type_into(calc, dp="2", reshard="false", param_dtype="bf16")
    assert calc.error is None
    assert calc.comm.by_op == fsdp_communication("debug-llama", 2, reshard_after_forward=False,
                                                 param_dtype="bf16").by_op
    type_into(calc, dp="8", reshard="int", reshard_k="4")
    assert [c.group for c in calc.comm.collectives if c.why.startswith("backward")] == [4] * 4
    _shows_one_state(calc.result.value, calc.figure, calc.error)


def test_fsdp_calculator_shows_only_stated_terms_and_the_bar_is_the_total():
    """The table lists the exact unsharded terms (no modelled buffer peaks), and the stacked bar
    is FSDPMemory.total: sharded states + unsharded_peak."""
    from labkit.plots import GB
    from labkit.plots.fsdp_calc import fsdp_bars

    calc = FSDPCalculator(model="debug-llama", dp=4, param_dtype="bf16", reduce_dtype="fp32")
    m = calc.memory
    assert "unsharded_peak" in calc.result.value and "gathered_grads" not in calc.result.value
    assert f"{m.unsharded_peak / GB:,.3f}" in calc.result.value
    fig = fsdp_bars({"a": m, "b": fsdp_memory("debug-llama", 4, per_block=False)})
    bars = fig.axes[0].patches
    first = sum(p.get_height() for p in bars[::2])
    assert first == pytest.approx((m.params + m.grads + m.optimizer_states + m.unsharded_peak)
                                  / GB)


@pytest.mark.parametrize("field, typed, start", [
    ("dp", "2.5", "dp (ranks)='2.5'"), ("dp", "0", "dp (ranks)=0"),
    ("prefetch", "-1", "prefetch=-1"), ("reshard_k", "3", "reshard k=3")])
def test_fsdp_calculator_bad_input(field, typed, start):
    calc = FSDPCalculator(model="debug-llama", dp=4, reshard="int", reshard_k=2)
    type_into(calc, **{field: typed})
    assert calc.memory is None and calc.error.startswith(start), calc.error
    assert "Cannot compute" in calc.result.value and calc.figure.value == b""
    type_into(calc, **{field: "2" if field != "prefetch" else "0"})
    assert calc.error is None and calc.memory is not None


def test_fsdp_calculator_says_when_a_rank_does_not_fit():
    """405B at dp=64 showed 'Per rank: 116.24 GB' on 80 GB GPUs without a word."""
    from labkit.hardware import GPUS

    calc = FSDPCalculator(model="llama3-405b", dp=64, param_dtype="bf16", gpu="h100-sxm")
    want = fsdp_memory("llama3-405b", 64, param_dtype="bf16", reduce_dtype="fp32")
    assert calc.memory.total == want.total > GPUS["h100-sxm"].memory
    assert calc.fits is False and "Does not fit" in calc.result.value
    assert "116.24 GB" in calc.result.value and "lower bound" in calc.result.value
    type_into(calc, dp="256")
    assert calc.fits is True and "Fits" in calc.result.value
    assert "Does not fit" not in calc.result.value
    type_into(calc, gpu="t4")
    assert calc.fits == (calc.memory.total <= GPUS["t4"].memory)
    _shows_one_state(calc.result.value, calc.figure, calc.error)


def test_checkpoint_calculator():
    calc = CheckpointCalculator(model="llama3-70b", gpus=1000, rate_pct=0.01)
    assert calc.mtbf == pytest.approx(10 * 86400)            # every 10 days, not 10 hours
    assert "10.00 days" in calc.result.value
    type_into(calc, gpus="16,000")
    assert calc.mtbf == pytest.approx(job_mtbf(16_000, 1e-4)) == pytest.approx(15 * 3600)
    slow = calc.interval
    type_into(calc, bandwidth_gbs=1000.0)
    assert calc.interval == pytest.approx(slow / 10 ** 0.5)  # sqrt(2 M delta), delta / 10
    type_into(calc, per_node=True, gpus_per_node="8")       # 2,000 nodes writing in parallel
    assert calc.write_time == pytest.approx(calc.size / (1000e9 * 2000))
    for field, typed, start in [("gpus", "abc", "GPUs='abc'"),
                                ("rate_pct", 0.0, "failures %/GPU/day=0.0"),
                                ("bandwidth_gbs", -1.0, "storage GB/s=-1.0"),
                                ("gpus", "0", "GPUs=0"),
                                ("gpus_per_node", "0", "GPUs per node=0")]:
        type_into(calc, **{field: typed})
        assert calc.error.startswith(start) and calc.interval is None, calc.error
        _shows_one_state(calc.result.value, calc.figure, calc.error)
        type_into(calc, gpus="1000", rate_pct=0.01, bandwidth_gbs=100.0, gpus_per_node="8")
        assert calc.error is None
