"""FSDP2 applied the way the course teaches it: per transformer block, then the root.

`shard_model(model, ...)` is the one place the labs, the lesson and the exercises turn a
transformers model into an FSDP2 model, so an option means the same everywhere:

    shard_model(model, per_block=True, reshard_after_forward=True,
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                prefetch=1, checkpoint_blocks=False, offload=False)

The order (torchtitan's): `shard_model`. It replaces module 04's `labkit.parallel.zero3`.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit import validate
from labkit.parallel import require_process_group

DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          torch.float32: torch.float32, torch.bfloat16: torch.bfloat16,
          torch.float16: torch.float16}


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model (Llama's `model.layers`, GPT-2's
    `transformer.h`), or of any module holding them (e.g. the labs' CausalLM wrapper): the
    largest nn.ModuleList found, in order."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            best = list(module)
    if not best:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks; pass "
                         "per_block=False to shard it as one unit")
    return best


def _dtype(name: str, value):
    try:
        return DTYPES[value]
    except (KeyError, TypeError):
        allowed = "None, 'fp32', 'bf16', 'fp16', torch.float32, torch.bfloat16, torch.float16"
        raise ValueError(f"{name}={value!r} is not a dtype FSDP2 casts to here; allowed: "
                         f"{allowed}") from None


def mixed_precision(param_dtype=None, reduce_dtype=None):
    """FSDP2's MixedPrecisionPolicy from dtypes or their names. param_dtype: what the
    all-gather sends and the forward/backward compute in (the fp32 shard stays the master copy);
    reduce_dtype: what the reduce-scatter sends and sums in (default: param_dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=_dtype("param_dtype", param_dtype),
                                reduce_dtype=_dtype("reduce_dtype", reduce_dtype))


def checkpoint_block(block: nn.Module) -> nn.Module:
    """Wrap `block` so its forward is recomputed in the backward (non-reentrant activation
    checkpointing; only the block's input is kept). Parameter names are unchanged for
    `torch.distributed.checkpoint.state_dict` (it drops the wrapper's prefix)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    return checkpoint_wrapper(block)


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for i, child in enumerate(module):
                if child is old:
                    module[i] = new
                    return
    raise ValueError("block not found in the model")


def shard_model(model: nn.Module, *, mesh=None, per_block: bool = True,
                reshard_after_forward: bool | int = True, param_dtype=None, reduce_dtype=None,
                prefetch: int = 0, checkpoint_blocks: bool = False,
                offload: bool = False) -> nn.Module:
    """Apply FSDP2 (`torch.distributed.fsdp.fully_shard`) to `model` in place and return it.

    per_block: one FSDP unit per transformer block, then the root; False: the whole model is one
        unit (its every weight is gathered at once: the peak is the whole model).
    reshard_after_forward: True frees each block's gathered weights after its forward and
        gathers them again for the backward (ZeRO-3); False keeps them until the backward
        (ZeRO-2-like: no backward all-gather, the gathered model stays alive); an int k reshards
        to groups of k ranks after the forward (the backward gathers within those k ranks);
        it must divide the world size and be at least 2 (the world size is the same as True;
        resharding to 1 rank would be False).
    param_dtype, reduce_dtype: `mixed_precision`. prefetch: explicitly prefetch this many next
        blocks in the forward and previous blocks in the backward
        (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`); 0 leaves FSDP2's
        implicit prefetching. checkpoint_blocks: `checkpoint_block` each block before sharding.
    offload: CPUOffloadPolicy: shards, gradients and the optimizer step live in host memory
        (on a CPU-only machine nothing moves; the policy still runs).

    Order (torchtitan's): activation checkpointing wraps each block first, then `fully_shard`
    on every block (one FSDP unit each: its parameters are all-gathered together), then on the
    root (embeddings, final norm, head and anything left). Like FSDP2's default, the root keeps
    its weights after the forward (the backward needs them at once), so the root never
    re-gathers: the model `labkit.comm.step_communication("fsdp", ...)` counts. The hand-built
    ZeRO-3 this replaces is `labkit.parallel.zero3.FullyShardedModel` (module 04).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    require_process_group("shard_model")
    import torch.distributed as dist
    world = dist.get_world_size()
    validate.choice("per_block", per_block, (True, False))
    validate.choice("checkpoint_blocks", checkpoint_blocks, (True, False))
    validate.choice("offload", offload, (True, False))
    if isinstance(reshard_after_forward, bool):
        pass
    elif isinstance(reshard_after_forward, int):
        k = reshard_after_forward
        if k < 2 or k > world or world % k:
            raise ValueError(
                f"reshard_after_forward={k}: an int must divide the world size {world} and be "
                f"at least 2; allowed: True, False or one of "
                f"{[d for d in range(2, world + 1) if world % d == 0]}")
        if k == world:
            reshard_after_forward = True
    else:
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: allowed True, False "
                         "or an int that divides the world size")
    if not (isinstance(prefetch, int) and not isinstance(prefetch, bool) and 0 <= prefetch <= 64):
        raise ValueError(f"prefetch={validate.describe(prefetch)} must be a whole number from 0 "
                         "to 64: 0 (the default) leaves FSDP2's implicit prefetching, k >= 1 "
                         "prefetches the next k blocks explicitly")
    if checkpoint_blocks and not per_block:
        raise ValueError("checkpoint_blocks=True checkpoints each block: it needs per_block=True")

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mixed_precision(param_dtype, reduce_dtype),
                  offload_policy=CPUOffloadPolicy(pin_memory=False) if offload
                  else OffloadPolicy())
    units = []
    if per_block:
        for block in transformer_blocks(model):
            if checkpoint_blocks:
                wrapped = checkpoint_block(block)
                _replace(model, block, wrapped)
                block = wrapped
            fully_shard(block, **kwargs)
            units.append(block)
    # The root keeps its weights after the forward (FSDP2's default, None, for the root): the
    # backward starts with the head and needs them at once. Alone (per_block=False) it follows
    # reshard_after_forward, so the whole-model unit shows ZeRO-3's behaviour.
    fully_shard(model, **{**kwargs, "reshard_after_forward":
                          None if per_block else reshard_after_forward})
    if prefetch and units:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + prefetch])
            unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch):i][::-1])
    return model


def units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a sharded model, in module order (blocks first, the root last)."""
    from torch.distributed.fsdp import FSDPModule
    found = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return found[1:] + found[:1] if found and found[0] is model else found
