"""Module 05's exercises: the FSDP2 runner (labkit.labs.fsdp.exercise), where a learner's wrapping
function, mixed-precision policy and DCP save/load reach the ranks and are measured, every usual
mistake coming back as a sentence with its numbers; and the references the check cells use."""
from __future__ import annotations

import pytest
import torch

from labkit.course import reference
from labkit.labs.common.tiny_llama import SPEC
from labkit.labs.fsdp.exercise import run_user_policy, run_user_resume, run_user_wrap

# ----------------------------------------------------------------------- learners' answers
# (module level, so that the runner finds their source in this file)

import os                                                                   # noqa: E402

import torch.distributed as dist                                            # noqa: E402
import torch.distributed.checkpoint as dcp                                  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions,     # noqa: E402
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard        # noqa: E402


def per_block(model):
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)


def blocks_only(model):
    for block in model.model.layers:
        fully_shard(block)


def whole_model(model):
    fully_shard(model)


def like_fsdp1(model):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, reshard_after_forward=False, mp_policy=mp)


def stub_wrap(model):
    raise NotImplementedError("Exercise wrap: write ~3 lines")


def save_ckpt(model, optimizer, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_ckpt(model, optimizer, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def save_model_only(model, optimizer, path):
    dcp.save({"model": get_state_dict(model, optimizer)[0]}, checkpoint_id=path)


def load_model_only(model, optimizer, path):
    state = {"model": get_state_dict(model, optimizer)[0]}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def load_nothing(model, optimizer, path):
    pass


def save_full_on_rank0(model, optimizer, path):
    state = get_state_dict(model, optimizer,
                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        os.makedirs(path)
        torch.save(state, os.path.join(path, "full.pt"))


def load_full(model, optimizer, path):
    model_sd, optim_sd = torch.load(os.path.join(path, "full.pt"), weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------- the references, without ranks

def test_the_checkpoint_references_are_the_formulas_they_stand_for():
    """0.01 %/GPU/day on 1,000 GPUs: 0.1 failures a day, one every 10 days (the seed's "every 10
    hours" is 24x off); Young's interval is sqrt(2 x write time x MTBF)."""
    day = 86_400
    assert reference.job_mtbf(1000, 1e-4) == pytest.approx(10 * day, rel=1e-12)
    assert reference.job_mtbf(16_000, 1e-4) == pytest.approx(day / 1.6, rel=1e-12)
    write, mtbf = 827.7e9 / 100e9, day / 1.6
    assert reference.checkpoint_interval(mtbf, write) == pytest.approx(
        (2 * write * mtbf) ** 0.5, rel=1e-12)


def test_the_exercise_model_shards_evenly_on_2_4_and_8_ranks():
    """Every parameter's dim 0 divides by 8: each shard is exactly 1/N, so 4P/N holds."""
    from labkit.labs.common.tiny_llama import build

    model = build(0)
    assert all(p.shape[0] % 8 == 0 for p in model.parameters())
    assert SPEC.tied_embeddings is False


@pytest.mark.parametrize("kwargs, words", [
    ({"nproc": 1}, "nproc=1: allowed 2, 4 or 8"),
    ({"nproc": 3}, "nproc=3: allowed 2, 4 or 8"),
    ({"nproc": 0}, "nproc=0 must be a whole number >= 1"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        run_user_wrap(per_block, **kwargs)


def test_resume_arguments_are_checked():
    with pytest.raises(ValueError, match="save_at=6 must be below steps=6"):
        run_user_resume(save_ckpt, load_ckpt, steps=6, save_at=6)
    from labkit.labs.common.tiny_llama import build
    with pytest.raises(ValueError, match="define save_ckpt and build in the same cell"):
        run_user_resume(save_ckpt, build)


def test_a_policy_must_be_a_mixed_precision_policy():
    with pytest.raises(ValueError, match="run_user_policy takes a torch.distributed.fsdp."
                                         "MixedPrecisionPolicy; received 'bf16' \\(a str\\)"):
        run_user_policy("bf16")


def test_a_stub_fails_at_once_without_ranks():
    with pytest.raises(NotImplementedError, match="stub_wrap is not written yet"):
        run_user_wrap(stub_wrap)


def test_a_class_is_refused_naming_what_it_takes():
    with pytest.raises(ValueError, match="run_user_wrap takes a function .* received <class"):
        run_user_wrap(MixedPrecisionPolicy)


# ---------------------------------------------------------------------------- on real ranks

@pytest.fixture(scope="module", autouse=True)
def _warm_pool():
    from labkit.runtime import pool
    pool.warm(preload=["transformers"])


@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_per_block_then_root_holds_4p_over_n_and_sends_what_labkit_predicts(nproc):
    r = run_user_wrap(per_block, nproc=nproc)
    assert r.ok, r.summary()
    P = sum(p.numel() for p in torch.nn.Module.parameters(_model()))
    assert r.params == P and r.local_bytes == [4 * P // nproc] * nproc
    assert sorted(r.units) == ["", "model.layers.0", "model.layers.1"]
    L = SPEC.num_layers
    # forward: every unit once; backward: the blocks again (the root keeps its weights)
    assert r.sent("all_gather")[0] == 2 * L + 1 and r.sent("reduce_scatter")[0] == L + 1
    assert r.sent("reduce_scatter")[1] == 4 * P          # each gradient reduced once, fp32
    assert r.diff_single < 1e-4


def _model():
    from labkit.labs.common.tiny_llama import build
    return build(0)


@pytest.mark.multirank
@pytest.mark.parametrize("fn, aspect, words", [
    (blocks_only, "units", "missing ['the root (the model itself)']"),
    (blocks_only, "bytes", "parameters are not sharded (e.g. model.embed_tokens.weight)"),
    (blocks_only, "trains", "differ from one process trained on the whole batch"),
    (whole_model, "units", "missing ['model.layers.0', 'model.layers.1']"),
    (whole_model, "collectives", "one step's all-gathers (weights): 1 calls, {S:,} B in "
                                 "['float32']; expected 5"),
])
def test_wrapping_mistakes_are_named_with_their_numbers(fn, aspect, words):
    r = run_user_wrap(fn, nproc=2)
    assert not r.ok
    assert words.format(S=4 * r.params) in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()


@pytest.mark.multirank
def test_fsdp1s_shard_grad_op_in_fsdp2_gathers_once_in_bf16_and_reduces_in_fp32():
    r = run_user_wrap(like_fsdp1, nproc=2)
    want = dict(reshard_after_forward=False, param_dtype="bf16", reduce_dtype="fp32")
    assert not r.problems(**want), r.summary(**want)
    P = r.params
    assert r.sent("all_gather") == (SPEC.num_layers + 1, 2 * P, ("bfloat16",))
    assert r.sent("reduce_scatter") == (SPEC.num_layers + 1, 4 * P, ("float32",))
    # judged by the defaults (ZeRO-3, fp32), the same run is wrong, with the numbers
    assert "one step's all-gathers (weights): 3 calls, " in r.verdicts()["collectives"]


@pytest.mark.multirank
def test_a_policy_is_judged_by_what_it_sends():
    good = run_user_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32))
    assert not good.problems(param_dtype="bf16", reduce_dtype="fp32"), good.summary()
    bad = run_user_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    v = bad.verdicts(param_dtype="bf16", reduce_dtype="fp32")["collectives"]
    assert f"reduce-scatters (gradients): 3 calls, {2 * bad.params:,} B in ['bfloat16']" in v
    assert f"expected 3, {4 * bad.params:,} B in ['float32']" in v


@pytest.mark.multirank
def test_a_dcp_resume_continues_the_loss_exactly():
    r = run_user_resume(save_ckpt, load_ckpt, nproc=2)
    assert r.ok, r.summary()
    assert r.resumed == r.uninterrupted[3:] and r.before == r.uninterrupted[:3]
    assert r.files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.multirank
@pytest.mark.parametrize("save, load, aspect, words", [
    (save_model_only, load_model_only, "resumed",
     "the optimizer's state (AdamW's moments and step) was not restored"),
    (save_ckpt, load_nothing, "model", "after load_nothing, the parameters differ from those "
                                       "saved"),
    (save_ckpt, load_nothing, "resumed", "the model was not restored"),
    (save_full_on_rank0, load_full, "sharded", "the checkpoint directory holds ['full.pt']: "
                                               "torch.distributed.checkpoint.save writes one "
                                               ".distcp file per rank (2) and a .metadata"),
])
def test_resume_mistakes_are_named_with_their_numbers(save, load, aspect, words):
    r = run_user_resume(save, load, nproc=2, steps=4, save_at=2)
    assert not r.ok
    assert words in r.verdicts()[aspect], r.summary()
