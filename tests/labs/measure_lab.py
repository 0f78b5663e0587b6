"""Fixture lab for tests/test_measure.py: measure DDP and FSDP2 in one launch and report.

    torchrun --nproc-per-node 4 tests/labs/measure_lab.py

Reports (per rank): ddp_grad_bytes, ddp_all_reduce (count, bytes); fsdp_full_param_bytes,
fsdp_local_param_bytes, fsdp_by_kind; funcol_by_kind; world_size.
"""
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.runtime import dist, measure

DIMS = [32, 64, 48, 16]     # every dim divides by 1, 2, 4, 8, 16: FSDP shards are exact


def make_model():
    torch.manual_seed(0)
    layers = []
    for i in range(len(DIMS) - 1):
        layers += [nn.Linear(DIMS[i], DIMS[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def train_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


ctx = dist.setup()
x = torch.randn(8, DIMS[0])

# DDP: after one warm-up step (bucket rebuild), one step's all-reduces carry every gradient once.
ddp = DDP(make_model())   # no buffers in this model: nothing to broadcast
opt = torch.optim.AdamW(ddp.parameters())
train_step(ddp, opt, x)
with measure.CollectiveCounter() as comm:
    train_step(ddp, opt, x)
state = measure.state_bytes(ddp, opt)
dist.report(world_size=ctx.world_size, ddp_grad_bytes=state.grads, ddp_param_bytes=state.params,
            ddp_all_reduce=comm.by_kind.get("all_reduce", (0, 0)), ddp_by_kind=comm.by_kind)

# FSDP2: each Linear its own group, then the root.
model = make_model()
full = measure.state_bytes(model).params
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
train_step(model, opt, x)
with measure.CollectiveCounter() as comm:
    train_step(model, opt, x)
local = measure.state_bytes(model, opt)
# Functional collectives (what DTensor/TP issue) name the group size instead of an output buffer.
with measure.CollectiveCounter() as fc:
    gathered = funcol.all_gather_tensor(torch.ones(8), 0, torch.distributed.group.WORLD)
    gathered = funcol.wait_tensor(gathered)
assert gathered.numel() == 8 * ctx.world_size
dist.report(funcol_by_kind=fc.by_kind)
dist.report(fsdp_full_param_bytes=full, fsdp_local_param_bytes=local.params,
            fsdp_local_grad_bytes=local.grads, fsdp_local_optimizer_bytes=local.optimizer_states,
            fsdp_by_kind=comm.by_kind)
dist.shutdown()
