"""No warning text in a lab's output that the lesson does not discuss (issue 28, item 4).

torch and transformers warn about things the labs never do (labkit.runtime.noise says why each
is noise); in a notebook they print in red, once per rank, and look like failures. Each is
silenced by category and message, only around the call that raises it: a pipeline lab (pp by
hand, transformers' `past_key_values` FutureWarning) and the 2D lab (FSDP2's view-tensor
UserWarning) run here at the smallest sizes they accept, and their output holds no warning.
The filters are narrow: the same message in another category, or another message, still shows.
"""
from __future__ import annotations

import warnings

import pytest

from labkit.runtime import noise
from labkit.runtime.launch import run_lab

NOISE = ("past_key_values", "returned a view tensor", "LeafSpec")


def warnings_in(output: list[str]) -> list[str]:
    return [line for line in output if "Warning" in line or any(n in line for n in NOISE)]


@pytest.mark.multirank
@pytest.mark.parametrize("lab, nproc, args", [
    ("labkit.labs.pp", 2, ["--part", "byhand", "--layers", "2", "--microbatches", "2",
                           "--repeats", "1", "--sleep", "0"]),
    ("labkit.labs.threed", 4, ["--part", "2d", "--steps", "1"]),
], ids=["pp-byhand", "threed-2d"])
def test_a_lab_s_output_holds_no_warning(lab, nproc, args):
    result = run_lab(lab, nproc=nproc, args=args, timeout=240, quiet=True)
    assert result.output, "the lab printed nothing: the check would be empty"
    found = warnings_in(result.output)
    assert not found, "warning text in the lab's output:\n" + "\n".join(found[:8])


def _shown(fn, *known) -> list[str]:
    """What fn warns (every warning recorded, as a lab's first call would show it), with the
    `known` noise ignored around the call."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with noise.ignoring(*known):
            fn()
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def test_only_the_named_warnings_are_silenced_and_only_inside():
    pkv = "`past_key_values` is deprecated and will be removed in version 5.40.0"

    def raise_all():
        warnings.warn(pkv, FutureWarning)
        warnings.warn(pkv, UserWarning)                     # same text, another category
        warnings.warn("find_unused_parameters=True was specified", UserWarning)   # DDP's: kept

    inside = _shown(raise_all, noise.PAST_KEY_VALUES, noise.FSDP2_VIEW, noise.LEAF_SPEC)
    assert inside == [f"UserWarning: {pkv}",
                      "UserWarning: find_unused_parameters=True was specified"]
    assert len(_shown(raise_all)) == 3                      # outside the `with`: all three


def test_the_patterns_match_what_torch_says():
    from torch.utils._pytree import LeafSpec

    assert any("LeafSpec" in w for w in _shown(LeafSpec))
    assert _shown(LeafSpec, noise.LEAF_SPEC) == []
    view = ("FSDP2-wrapped module (FSDPLlamaForCausalLM) returned a view tensor. An in-place op "
            "on this view (e.g., `x += y`) will silently drop the pre-backward hook")
    assert _shown(lambda: warnings.warn(view, UserWarning), noise.FSDP2_VIEW) == []
