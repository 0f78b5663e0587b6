"""The memory calculator driven from plain pytest (no kernel): set control values as a learner
would, and check that the verdict, the breakdown and the figure follow `estimate_memory`."""
from __future__ import annotations

import html

import pytest
import traitlets

from labkit.hardware import GPUS
from labkit.memory import estimate_memory, tp_degrees
from labkit.models import PRESETS, get_model
from labkit.plots import fmt_bytes, fmt_count
from labkit.widgets.memory import CUSTOM_FIELDS, TYPED, MemoryCalculator
from test_calculator_properties import type_into as _set



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
                                           ("dp", 2),
                                           ("gpu", "a100-40gb")])
def test_each_control_is_wired(control, value):
    calc = MemoryCalculator(model="llama2-13b", seq_len=2048)
    before = (calc.verdict.value, calc.breakdown.value)
    _set(calc, **{control: value})
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


def test_tp_offers_only_the_degrees_that_divide_the_heads():
    calc = MemoryCalculator(model="llama2-7b")
    assert list(calc.controls["tp"].options) == tp_degrees("llama2-7b") == [1, 2, 4, 8, 16, 32]
    with pytest.raises(traitlets.TraitError):
        calc.controls["tp"].value = 3                 # not offered: the browser cannot pick it
    with pytest.raises(ValueError, match=r"^tp=3 does not divide 32 attention heads; try 1, "
                                         r"2, 4, 8, 16 or 32$"):
        MemoryCalculator(model="llama2-7b", tp=3)
    with pytest.raises(ValueError, match="tp=16 does not divide 8 KV heads; try 1, 2, 4 or 8"):
        MemoryCalculator(model="llama2-70b", tp=16)
    with pytest.raises(ValueError, match="pp=40 is more than the 32 layers of llama2-7b"):
        MemoryCalculator(model="llama2-7b", pp=40)
    # GPT-2 has 12 heads: tp=3 works there, and the choice is offered.
    calc = MemoryCalculator(model="gpt2", tp=3)
    assert calc.error is None and calc.inputs()["tp"] == 3
    assert calc.estimate.total == estimate_memory("gpt2", seq_len=1024, tp=3).total


def test_a_new_model_moves_tp_and_pp_it_cannot_take_and_says_so():
    calc = MemoryCalculator(model="llama2-70b", tp=8, pp=80)
    calc.controls["model"].value = "gpt2"             # 12 heads, 12 layers
    assert list(calc.controls["tp"].options) == tp_degrees("gpt2")
    assert calc.controls["tp"].value == 6 and calc.controls["pp"].value == 12
    assert "tp=8 does not divide 12 attention heads; try 1, 2, 3, 4, 6 or 12; tp is now 6" \
        in calc.note.value
    assert "pp=80 is more than the 12 layers of gpt2" in calc.note.value
    assert calc.error is None
    assert calc.estimate.total == estimate_memory("gpt2", seq_len=1024, tp=6, pp=12).total
    calc.controls["zero_stage"].value = 1             # the note was about the model change
    assert calc.note.value == ""
    # A custom shape is followed as it is typed: 40 heads (and KV heads) take tp=8 but not 16.
    calc = MemoryCalculator(model="custom", tp=16)
    _set(calc, heads=40, kv_heads=40, hidden=5120)
    assert calc.controls["tp"].value == 8 and "tp=16 does not divide 40 attention heads" in \
        calc.note.value
    assert calc.error is None


def test_error_state_hides_the_figure_and_recovers():
    calc = MemoryCalculator(model="custom")
    _set(calc, kv_heads=5)
    with pytest.raises(ValueError) as exc:
        calc.model()
    assert calc.estimate is None and calc.error == calc.error_text(exc.value)
    assert "kv_heads=5 does not divide heads=32" in calc.verdict.value   # as labelled
    assert "Cannot compute" in calc.verdict.value
    # No image rather than an empty one (which a browser draws as a broken-image icon).
    assert calc.breakdown.value == "" and bytes(calc.figure.value) == b""
    assert calc.figure.layout.display == "none"
    _set(calc, kv_heads=8)
    assert calc.error is None and calc.figure.layout.display != "none"
    assert bytes(calc.figure.value).startswith(b"\x89PNG")


@pytest.mark.parametrize("values,needle", [
    ({"dp": 0}, "dp=0 must be a whole number >= 1"),
    ({"model": "gpt2", "seq_len": 4096}, "exceeds the 1024 learned positions"),
    ({"model": "custom", "heads": 32, "kv_heads": 5}, "kv_heads=5 does not divide heads=32"),
    ({"model": "custom", "layers": 0}, "layers=0 must be a whole number >= 1"),
    ({"dp": 99_999_999_999}, "dp=99999999999 must be a whole number >= 1 and <= 1e7"),
    ({"batch_size": 10**9}, "micro-batch=1000000000 must be a whole number >= 1 and <= 1e8"),
    ({"model": "custom", "hidden": 10**9}, "hidden=1000000000 must be a whole number >= 1 "
                                           "and <= 1e8"),
    ({"model": "custom", "vocab": 10**300}, "vocab=1.00e300 must be a whole number >= 1 "
                                            "and <= 1e8"),
    ({"model": "custom", "ffn": 10**7, "hidden": 10**7, "heads": 1, "kv_heads": 1},
     "allowed: at most 1e15"),
])
def test_bad_input_is_a_message_not_a_traceback(values, needle):
    calc = MemoryCalculator()
    _set(calc, **values)
    assert calc.estimate is None
    assert needle in calc.error
    assert html.escape(needle) in calc.verdict.value
    assert len(calc.error) < 300                      # no 300-digit numbers


@pytest.mark.parametrize("text", ["2.5", "1e3", "", "eight", "0x10"])
def test_typed_whole_numbers_refuse_anything_but_digits(text):
    """IntText's front end turned '2.5' into 25 and '1e3' into 13; these fields take the text as
    typed and name every field that is not a whole number, all at once."""
    calc = MemoryCalculator(model="custom")
    names = list(TYPED) + list(CUSTOM_FIELDS)
    _set(calc, **{name: text for name in names})
    assert calc.estimate is None and calc.figure.layout.display == "none"
    for name in names:
        assert f"{calc.controls[name].description}={text!r} is not a whole number" in calc.error
    _set(calc, dp="1,024", batch_size=" 2 ", microbatches="1_000", layers="32", hidden="4096",
         heads="32", kv_heads="8", ffn="14336", vocab="128,256")
    assert calc.error is None
    assert calc.inputs()["dp"] == 1024 and calc.inputs()["microbatches"] == 1000
    assert calc.model().vocab_size == 128256


def test_model_labels_use_an_adaptive_unit():
    labels = dict((v, k) for k, v in MemoryCalculator().controls["model"].options)
    assert labels["debug"] == "debug (853K params)"            # 853,120 parameters
    assert labels["gpt2"] == "gpt2 (124M params)"              # 124,439,808
    assert labels["llama2-7b"] == "llama2-7b (6.74B params)"
    assert labels["llama3-405b"] == "llama3-405b (406B params)"
    assert all("0.00B" not in label for label in labels.values())
    assert fmt_count(PRESETS["debug"].num_params()) in labels["debug"]


@pytest.mark.parametrize("n,shown", [(0, "0"), (950, "950"), (12_345, "12.3K"), (853_120, "853K"),
                                     (999_950, "1.00M"), (1_180_000, "1.18M"),
                                     (68_976_648_192, "69.0B"), (1.2e12, "1.20T")])
def test_fmt_count(n, shown):
    assert fmt_count(n) == shown


def test_custom_shape_is_a_llama_model():
    calc = MemoryCalculator(model="custom", layers=32, hidden=4096, heads=32, kv_heads=32,
                            ffn=11008, vocab=32000)
    assert calc._custom_box.layout.display == ""
    # Llama-2-7B's shape typed by hand gives Llama-2-7B's memory.
    assert calc.estimate.total == estimate_memory("llama2-7b", seq_len=4096).total
    assert f"custom: {fmt_count(PRESETS['llama2-7b'].num_params())} parameters" in \
        calc.breakdown.value
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
