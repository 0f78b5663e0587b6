"""Fixture lab for tests/test_parallel_fsdp.py: labkit.parallel.fsdp.shard_model on real ranks.

    torchrun --nproc-per-node 2 tests/labs/fsdp_shard_checks.py

Every rank reports:
- `errors`: {case: "ExceptionType: message"} for each bad input in BAD (shard_model called on
  a fresh model; None where it did not raise);
- `units`: the class name of each FSDP unit in labkit.parallel.fsdp.units' order, and
  `blocks`: the blocks' class name;
- `gathers`: {unit label: forward/backward all-gathers issued} in one step after a warm-up
  (labkit.labs._fsdp_timeline), `reshard`: the same with reshard_after_forward=False;
- `names`, `names_checkpointed`: the sorted keys of torch.distributed.checkpoint.state_dict's
  get_model_state_dict, for the model sharded without and with checkpoint_blocks; `plain_names`:
  the unsharded model's state_dict keys;
- rank 0 only: `loss_diff` and `param_diff`: the largest difference from a 1-process AdamW
  reference trained on the whole batch (each rank trains on its half), over STEPS steps.
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from labkit.labs._fsdp_common import build
from labkit.labs._fsdp_timeline import Timeline
from labkit.parallel.fsdp import shard_model, transformer_blocks, units
from labkit.runtime import dist

ARGS = argparse.Namespace(model="llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=128,
                          seq=16, batch=2, seed=0)
STEPS, LR = 3, 1e-2
BAD = {"per_block": dict(per_block="yes"), "reshard_3": dict(reshard_after_forward=3),
       "reshard_1": dict(reshard_after_forward=1), "reshard_str": dict(reshard_after_forward="x"),
       "prefetch_neg": dict(prefetch=-1), "param_dtype": dict(param_dtype="int8"),
       "reduce_dtype": dict(reduce_dtype=torch.int32),
       "checkpoint_whole": dict(checkpoint_blocks=True, per_block=False),
       "offload": dict(offload="yes")}


def batch(step: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, ARGS.vocab, (world * ARGS.batch, ARGS.seq), generator=gen)


def one_step(model, opt, ids) -> float:
    loss = model(ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def errors() -> dict:
    out = {}
    for case, kwargs in BAD.items():
        model, _ = build(ARGS, "cpu")
        try:
            shard_model(model, **kwargs)
            out[case] = None
        except Exception as exc:            # reported for the test to read
            out[case] = f"{type(exc).__name__}: {exc}"
    try:
        shard_model(nn.Sequential(nn.Linear(4, 4)))
        out["no_blocks"] = None
    except Exception as exc:
        out["no_blocks"] = f"{type(exc).__name__}: {exc}"
    return out


def gathers(base, ctx, **kwargs) -> dict:
    model = shard_model(copy.deepcopy(base), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = batch(0, ctx.world_size)[: ARGS.batch]
    one_step(model, opt, ids)
    with Timeline(model) as rec:
        one_step(model, opt, ids)
    counts: dict = {}
    for e in rec.events:
        if e["what"] == "all_gather":
            counts[e["unit"]] = counts.get(e["unit"], 0) + 1
    return counts


def state_names(base, **kwargs) -> list:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return sorted(get_model_state_dict(shard_model(copy.deepcopy(base), **kwargs)))


def parity(base, ctx) -> tuple[float, float]:
    model = shard_model(copy.deepcopy(base))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    b = ARGS.batch
    loss_diff = 0.0
    for step in range(STEPS):
        ids = batch(step, ctx.world_size)
        mine = torch.tensor(one_step(model, opt, ids[ctx.rank * b:(ctx.rank + 1) * b]))
        torch.distributed.all_reduce(mine)
        whole = one_step(ref, ref_opt, ids)
        loss_diff = max(loss_diff, abs(mine.item() / ctx.world_size - whole))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    param_diff = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return loss_diff, param_diff


def main() -> None:
    ctx = dist.setup()
    base, _ = build(ARGS, "cpu")
    sharded = shard_model(copy.deepcopy(base))
    out = dict(errors=errors(), units=[type(u).__name__ for u in units(sharded)],
               blocks=type(transformer_blocks(base)[0]).__name__,
               gathers=gathers(base, ctx), reshard=gathers(base, ctx, reshard_after_forward=False),
               names=state_names(base),
               names_checkpointed=state_names(base, checkpoint_blocks=True),
               plain_names=sorted(base.state_dict()))
    loss_diff, param_diff = parity(base, ctx)
    if ctx.rank == 0:
        out.update(loss_diff=loss_diff, param_diff=param_diff)
    dist.report(**out)
    dist.shutdown()


if __name__ == "__main__":
    main()
