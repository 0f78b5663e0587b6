"""The memory calculator driven from plain pytest (no kernel): set control values as a learner
would, and check that the verdict, the breakdown and the figure follow `estimate_memory`."""
from __future__ import annotations

import html

import pytest

from labkit.hardware import GPUS
from labkit.memory import estimate_memory
from labkit.models import get_model
from labkit.plots import fmt_bytes
from labkit.widgets.memory import MemoryCalculator


def _set(calc, **values):
    for name, value in values.items():
        calc.controls[name].value = value


def test_defaults_match_estimate_memory():
    calc = MemoryCalculator()
    expected = estimate_memory("llama2-7b", batch_size=1, seq_len=4096, precision="bf16-mixed",
                               optimizer="adamw", zero_stage=0, dp=1, tp=1, pp=1)
    assert calc.error is None
    assert calc.estimate.total == expected.total
    assert fmt_bytes(expected.total) in calc.verdict.value
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    # The breakdown shows every term in GB and GiB.
    for term in ("weights", "gradients", "optimizer states", "activations", "total"):
        assert f"<td>{term}</td>" in calc.breakdown.value
    assert f"{expected.optimizer_states / 1e9:,.2f}" in calc.breakdown.value
    assert f"{expected.optimizer_states / 2**30:,.2f}" in calc.breakdown.value


def test_verdict_flips_and_figure_changes_when_sharding():
    calc = MemoryCalculator(model="llama2-7b", seq_len=4096, recompute="none", gpu="h100-sxm")
    assert "Does not fit" in calc.verdict.value
    png_before, breakdown_before = bytes(calc.figure.value), calc.breakdown.value

    _set(calc, recompute="selective", zero_stage=3, dp=8)
    expected = estimate_memory("llama2-7b", batch_size=1, seq_len=4096, zero_stage=3, dp=8,
                               recompute="selective")
    assert expected.fits("h100-sxm")
    assert calc.estimate.total == expected.total
    assert "Fits" in calc.verdict.value and "Does not fit" not in calc.verdict.value
    assert fmt_bytes(expected.total) in calc.verdict.value
    png_after = bytes(calc.figure.value)
    assert png_after != png_before and png_after.startswith(b"\x89PNG")
    assert calc.breakdown.value != breakdown_before
    assert "8 GPU(s) in all" in calc.breakdown.value


@pytest.mark.parametrize("control,value", [("precision", "fp32"), ("optimizer", "sgd"),
                                           ("batch_size", 4), ("seq_len", 1024),
                                           ("recompute", "full"), ("tp", 4), ("pp", 4),
                                           ("gpu", "a100-40gb")])
def test_each_control_is_wired(control, value):
    calc = MemoryCalculator(model="llama2-13b", seq_len=2048)
    before = (calc.verdict.value, calc.breakdown.value)
    calc.controls[control].value = value
    assert calc.error is None
    assert calc.estimate.total == estimate_memory(**calc.inputs()).total
    assert calc.inputs().get(control, value) == value
    assert (calc.verdict.value, calc.breakdown.value) != before


def test_gpu_choice_changes_only_the_verdict():
    calc = MemoryCalculator(model="llama2-7b", zero_stage=1, dp=8, recompute="full",
                            gpu="h100-sxm")
    assert "Fits" in calc.verdict.value
    total = calc.estimate.total
    calc.controls["gpu"].value = "t4"
    assert calc.estimate.total == total
    assert total > GPUS["t4"].memory
    assert "Does not fit" in calc.verdict.value and html.escape(GPUS["t4"].name) in \
        calc.verdict.value


def test_bad_tp_shows_the_message_and_recovers():
    calc = MemoryCalculator(model="llama2-7b")
    calc.controls["tp"].value = 3
    with pytest.raises(ValueError) as exc:
        estimate_memory("llama2-7b", seq_len=4096, tp=3)
    assert calc.estimate is None and calc.error == str(exc.value)
    assert "tp=3 does not divide num_heads=32" in calc.verdict.value
    assert "Cannot compute" in calc.verdict.value
    assert calc.breakdown.value == "" and bytes(calc.figure.value) == b""
    calc.controls["tp"].value = 4
    assert calc.error is None and "Fits" in calc.verdict.value
    assert bytes(calc.figure.value).startswith(b"\x89PNG")


@pytest.mark.parametrize("values,needle", [
    ({"dp": 0}, "dp=0 must be a whole number >= 1"),
    ({"model": "gpt2", "seq_len": 4096}, "exceeds the 1024 learned positions"),
    ({"model": "custom", "heads": 32, "kv_heads": 5}, "num_kv_heads=5 does not divide"),
    ({"model": "custom", "layers": 0}, "num_layers=0 must be a whole number >= 1"),
])
def test_bad_input_is_a_message_not_a_traceback(values, needle):
    calc = MemoryCalculator()
    _set(calc, **values)
    assert calc.estimate is None
    assert needle in calc.error
    assert html.escape(needle) in calc.verdict.value


def test_custom_shape_is_a_llama_model():
    calc = MemoryCalculator(model="custom", layers=32, hidden=4096, heads=32, kv_heads=32,
                            ffn=11008, vocab=32000)
    assert calc._custom_box.layout.display == ""
    # Llama-2-7B's shape typed by hand gives Llama-2-7B's memory.
    assert calc.estimate.total == estimate_memory("llama2-7b", seq_len=4096).total
    calc.controls["model"].value = "llama2-7b"
    assert calc._custom_box.layout.display == "none"


def test_unknown_initial_control_is_refused():
    with pytest.raises(ValueError, match="unknown control"):
        MemoryCalculator(zero=3)


def test_picking_gpt2_moves_the_sequence_to_its_1024_positions():
    calc = MemoryCalculator(model="llama2-7b")
    assert calc.controls["seq_len"].value == 4096
    calc.controls["model"].value = "gpt2"
    assert calc.controls["seq_len"].value == get_model("gpt2").max_seq_len == 1024
    assert calc.error is None and calc.estimate.total == estimate_memory("gpt2", seq_len=1024).total
    calc.controls["model"].value = "llama2-7b"        # a longer context leaves the choice alone
    assert calc.controls["seq_len"].value == 1024
    # An explicit choice is kept, and an impossible one is explained.
    assert MemoryCalculator(model="gpt2", seq_len=2048).error.startswith("seq_len=2048 exceeds")
