"""Fixture lab for tests/test_mesh.py: labkit.parallel.mesh on 4 real ranks.

    torchrun --nproc-per-node 4 tests/labs/mesh_2d.py

Reports, per rank:
- `groups`: {mesh name: {axis: the global ranks of this rank's group}} read from the DeviceMesh
  that Degrees.build_mesh made (dp2 x tp2, and dp2 x cp2 with dp and cp flattened as
  `parallelize` does for FSDP), to compare with Degrees.groups(axis) computed in pure Python;
- `losses`: {variant: [loss per step]} of a transformers Llama composed by `parallelize` on the
  dp2 x tp2 mesh (TP -> activation checkpointing -> FSDP2), the loss averaged over the dp group,
  and `reference`: the same model trained on one process over the whole batch;
- `placements`: one TP'd weight's DTensor mesh axes and placements after the composition, and
  `checkpointed`: how many decoder layers are wrapped for recomputation.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as tdist

from labkit.parallel.mesh import AXES, Degrees, parallelize
from labkit.runtime import dist

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, SEQ, BATCH, STEPS = 2, 32, 4, 2, 64, 16, 4, 3


def build():
    from labkit.labs.memory import build_model
    from labkit.models import get_model

    spec = get_model("debug-llama").with_(
        name="mesh-llama", num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS,
        num_kv_heads=KV_HEADS, ffn_size=2 * HIDDEN, vocab_size=VOCAB, max_seq_len=64)
    torch.manual_seed(0)
    return build_model(spec, None, torch.float32, "sdpa").train(), spec


def batch(step):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train(model, ids_of, group=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = ids_of(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if group is not None:                    # equal shards: the mean of the dp means
            tdist.all_reduce(value, group=group)
            value /= tdist.get_world_size(group)
        losses.append(value.item())
    return losses


def group_ranks(mesh, names):
    return {n: tdist.get_process_group_ranks(mesh[n].get_group()) for n in names}


def main():
    ctx = dist.setup("gloo")
    out = {}
    deg = Degrees.for_world(ctx.world_size, tp=2)
    mesh = deg.build_mesh("cpu")
    cp_mesh = Degrees.for_world(ctx.world_size, cp=2).build_mesh("cpu")
    flat = cp_mesh["dp", "cp"]._flatten("dp_cp")
    out["groups"] = {"dp2_tp2": group_ranks(mesh, AXES),
                     "dp2_cp2": {**group_ranks(cp_mesh, AXES),
                                 "dp_cp": tdist.get_process_group_ranks(flat.get_group())}}
    base, spec = build()
    out["reference"] = train(copy.deepcopy(base), batch)
    dp_rank, dp = mesh["dp"].get_local_rank(), deg.dp
    mine = lambda step: batch(step).chunk(dp)[dp_rank]                 # noqa: E731
    out["losses"] = {}
    for name, ac in (("tp_fsdp", False), ("tp_ac_fsdp", True)):
        model = parallelize(copy.deepcopy(base), mesh, activation_checkpoint=ac)
        if ac:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointWrapper)
            out["checkpointed"] = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
        else:
            w = model.model.layers[0].self_attn.q_proj.weight
            out["placements"] = {"mesh": list(w.device_mesh.mesh_dim_names),
                                 "placements": [str(p) for p in w.placements],
                                 "local_shape": list(w.to_local().shape),
                                 "full_shape": list(w.shape)}
        out["losses"][name] = train(model, mine, mesh["dp"].get_group())
    dist.report(**out)
    dist.shutdown()


if __name__ == "__main__":
    main()
