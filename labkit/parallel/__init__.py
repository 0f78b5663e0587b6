"""Parallelism by hand (layer 4): reference implementations that run inside ranks.

One file per axis, picotron-style, the naive version beside the optimised one, each tested
against a single-device reference: `ddp` (NaiveDDP, OverlappedDDP, BucketedDDP), `zero`
(ShardedOptimizer = ZeRO-1, ShardedGradientOptimizer = ZeRO-2), `zero3` (FullyShardedModel),
`tensor` (Megatron f/g, column/row parallel layers, sequence parallelism), `pipe` (GPipe and 1F1B
over send/recv), `mesh` (validated degrees, named DeviceMesh axes, the ordered composition TP ->
activation checkpointing -> FSDP), `context` (ring attention), `expert` (MoE routing and expert
parallelism over all-to-all). Modules 03-10 fill this folder; their shared helpers are below.

May import: torch, layer 1 and runtime/. Never labs/, course/, cli/ or the views.
"""

import math

from labkit.validate import MAX_PARAMS, MAX_RANKS, positive_int


def require_process_group(name: str) -> None:
    """Raise, naming `name` and the fix, unless torch.distributed is initialised here."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name} needs the process group, and torch.distributed is not "
                           "initialised in this process: call labkit.runtime.dist.setup() (or "
                           "torch.distributed.init_process_group) first, on every rank")


def padded_size(numel, world_size) -> int:
    """Elements of a flat buffer of `numel` padded to split into `world_size` equal shards:
    world_size * ceil(numel / world_size). The padding is fewer than world_size elements.
    Shared by ZeRO-1/2's flat buffer (`zero`) and ZeRO-3's per-parameter shards (`zero3`)."""
    n = positive_int("world_size", world_size, MAX_RANKS)
    p = positive_int("numel", numel, MAX_PARAMS)
    return n * math.ceil(p / n)
