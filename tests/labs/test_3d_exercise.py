"""Module 08's exercises: the 2D runner (labkit.labs.threed.exercise), where a learner's TP + FSDP
composition reaches 4 ranks and is compared with one process, every usual mistake coming back
as a sentence with its numbers; and the references the check cells use (the mesh groups against
a real DeviceMesh, the feasibility kinds against the planner's published layouts)."""
from __future__ import annotations

import pytest
import torch

from labkit.course import reference
from labkit.labs.threed.exercise import run_user_2d

# ----------------------------------------------------------------------- learners' answers
# (module level, so that the runner finds their source in this file)

from torch.distributed.fsdp import fully_shard                             # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel,            # noqa: E402
                                               RowwiseParallel, parallelize_module)


def _plan():
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return plan


def tp_then_fsdp(model, mesh):
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], _plan())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def tp_only(model, mesh):
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], _plan())


def fsdp_only(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def stub(model, mesh):
    raise NotImplementedError("Exercise compose: write ~9 lines")


# ---------------------------------------------------------------- arguments, without ranks

def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nproc=2: allowed 4 or 8"):
        run_user_2d(tp_then_fsdp, nproc=2)
    with pytest.raises(ValueError, match="run_user_2d takes a function fn\\(model, mesh\\) .* "
                                         "received 'f' \\(a str\\)"):
        run_user_2d("f")


def test_a_stub_fails_at_once_without_ranks():
    with pytest.raises(NotImplementedError, match="stub is not written yet"):
        run_user_2d(stub)


# ------------------------------------------------------------------------------ references

@pytest.mark.parametrize("shape, names", [
    ((2, 2), ("dp", "tp")), ((2, 2, 2), ("pp", "dp", "tp")), ((4, 2), ("tp", "dp")),
    ((2, 1, 4), ("pp", "cp", "tp")), ((2, 2, 2, 2), ("pp", "dp", "cp", "tp"))])
def test_mesh_groups_reference_is_what_a_real_device_mesh_gives_every_rank(shape, names):
    """init_device_mesh on a fake process group of the mesh's size, once per rank: the group of
    each axis that contains the rank is one of the reference's, and every group is seen."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    want = reference.mesh_groups(shape, names)
    seen = {n: set() for n in names}
    for rank in range(math.prod(shape)):
        dist.init_process_group("fake", rank=rank, world_size=math.prod(shape),
                                store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            for n in names:
                group = mesh[n].mesh.flatten().tolist()
                assert rank in group and group in want[n], (n, rank, group, want[n])
                seen[n].add(tuple(group))
        finally:
            dist.destroy_process_group()
    assert {n: sorted(map(list, g)) for n, g in seen.items()} == want


def test_mesh_groups_puts_tp_neighbours_on_one_node():
    """3D pp2 x dp2 x tp2: TP pairs are neighbours, DP jumps by tp, PP by tp x dp."""
    groups = reference.mesh_groups((2, 2, 2), ("pp", "dp", "tp"))
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_problem_agrees_with_the_planner_on_published_layouts():
    """The feasibility reference passes what the planner's tests find fitting (Llama 3 405B's
    reported degrees, with the full recompute the reference assumes, though the paper ran
    without: labkit prices that over 80 GB; Megatron's GPT-3 175B) and rejects, with its kind, what cannot run."""
    assert reference.layout_problem("llama3-405b", 8, 16, 128, global_batch=2048,
                                    seq_len=8192) is None
    assert reference.layout_problem("gpt3-175b", 8, 12, 16, gpu="a100-80gb",
                                    global_batch=1536, seq_len=2048) is None
    kind = reference.by_kind(reference.layout_problem)
    assert kind("llama3-405b", 8, 1, 8, global_batch=64, seq_len=8192) == "memory"
    assert kind("llama3-70b", 16, 1, 4) == "tp across nodes"
    assert kind("llama3-70b", 8, 1, 4, cp=3) == "divisibility"
    assert kind("llama3-70b", 8, 1, 6) == "batch"          # 512 sequences over 6


def test_utilisation_hfu_exceeds_mfu_only_with_recompute():
    mfu, hfu = reference.utilisation("llama3-70b", 4e5, 256, "h100-sxm", 8192)
    assert mfu == hfu
    mfu, hfu = reference.utilisation("llama3-70b", 4e5, 256, "h100-sxm", 8192, "full")
    assert 1.25 < hfu / mfu < 1.34          # one more forward of the layers: about 4/3
    assert reference.dp_for(16384, 8, 16) == 128
    with pytest.raises(ValueError, match="gpus=64 is not a multiple of tp x pp x cp = 24"):
        reference.dp_for(64, 8, 3)


# ---------------------------------------------------------------------------- on real ranks

_RUNS: dict = {}

@pytest.mark.multirank
def test_tp_then_fsdp_trains_as_one_process_with_a_quarter_of_the_layers():
    r = run_user_2d(tp_then_fsdp, nproc=4)
    assert r.ok, r.summary()
    assert r.losses == pytest.approx(r.single_losses, rel=1e-4)
    assert len(set(r.local_bytes)) == 1 and r.local_bytes[0] == r.predicted_bytes
    assert r.whole_bytes / 4 < r.predicted_bytes < r.whole_bytes / 2   # embeddings only / dp
    assert r.placements["model.layers.0.self_attn.o_proj.weight"]["tp"] == "Shard(1)"


@pytest.mark.multirank
@pytest.mark.parametrize("fn, aspect, words", [
    (tp_only, "bytes", "(ratio 2.00;"),
    (tp_only, "fsdp", "21 of 21 parameters are not sharded over the 'dp' axis"),
    (tp_only, "trains", "the gradients must be averaged over the 'dp' axis"),
    (fsdp_only, "tp", "model.layers.0.self_attn.q_proj.weight is not sharded on the 'tp' axis; "
                      "expected Shard(0) (column-parallel: each tp rank keeps a block of "
                      "the weight's rows"),
    (fsdp_only, "bytes", "a rank holds 213,632 B of parameters; predicted 139,904 B (ratio 1.53"),
])
def test_mistakes_are_named_with_their_numbers(fn, aspect, words):
    r = _RUNS.get(fn) or _RUNS.setdefault(fn, run_user_2d(fn, nproc=4))   # one run per mistake
    assert not r.ok
    assert words in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()
