"""labkit.parallel.fsdp.shard_model on 2 gloo ranks (tests/fixtures/labs/fsdp_shard_checks.py, run once
for the whole file): bad inputs refused with a message naming the argument and what is allowed,
the units in order (blocks, then the root), the root gathered once per step (it keeps its
weights from the forward to the backward), activation checkpointing leaving the state-dict
names alone, and the loss and final weights of a 1-process AdamW reference."""
from __future__ import annotations

from pathlib import Path

import pytest

from labkit.runtime.launch import run_lab

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
LAYERS = 2


@pytest.fixture(scope="module")
def checks():
    return run_lab(LABS / "fsdp_shard_checks.py", nproc=2, timeout=200, quiet=True).results


# argument named, what was given, what is allowed (a fragment of each)
EXPECTED = {
    "per_block": ("per_block", "'yes'", "True, False"),
    "reshard_3": ("reshard_after_forward", "3", "[2]"),
    "reshard_1": ("reshard_after_forward", "1", "[2]"),
    "reshard_str": ("reshard_after_forward", "'x'", "True, False"),
    "param_dtype": ("param_dtype", "'int8'", "'bf16'"),
    "reduce_dtype": ("reduce_dtype", "torch.int32", "torch.bfloat16"),
    "checkpoint_whole": ("checkpoint_blocks", "True", "per_block=True"),
    "offload": ("offload", "'yes'", "True, False"),
    "no_blocks": ("per_block", "Sequential", "per_block=False"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_inputs_are_refused_with_a_clear_message(checks, case):
    for r in checks:
        message = r["errors"][case]
        assert message is not None and message.startswith("ValueError: "), (case, message)
        for fragment in EXPECTED[case]:
            assert fragment in message, (case, fragment, message)


@pytest.mark.multirank
def test_a_negative_prefetch_is_refused_saying_that_0_is_allowed(checks):
    message = checks[0]["errors"]["prefetch_neg"]
    assert message.startswith("ValueError: ") and "prefetch=-1" in message
    assert ">= 0" in message or "0 (" in message, message


def test_shard_model_without_a_process_group_says_what_to_do():
    from torch import nn

    from labkit.parallel.fsdp import shard_model

    with pytest.raises(Exception, match="shard_model"):
        shard_model(nn.Linear(4, 4))


@pytest.mark.multirank
def test_units_are_the_blocks_in_order_then_the_root(checks):
    for r in checks:
        assert r["units"] == [f"FSDP{r['blocks']}"] * LAYERS + ["FSDPCausalLM"]


@pytest.mark.multirank
def test_the_root_is_gathered_once_and_each_block_twice(checks):
    for r in checks:
        blocks = {f"block{i}": 2 for i in range(LAYERS)}
        assert r["gathers"] == {"root": 1, **blocks}
        # reshard_after_forward=False: no backward all-gather for anyone
        assert r["reshard"] == {"root": 1, **{k: 1 for k in blocks}}


@pytest.mark.multirank
def test_activation_checkpointing_keeps_the_state_dict_names(checks):
    for r in checks:
        assert r["names_checkpointed"] == r["names"] == r["plain_names"]
        assert not any("checkpoint" in n for n in r["names_checkpointed"])


@pytest.mark.multirank
def test_sharded_training_equals_one_process(checks):
    r = checks[0]
    assert r["loss_diff"] < 1e-5
    assert r["param_diff"] < 1e-5
