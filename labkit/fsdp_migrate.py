"""Reading an FSDP1 codebase: each `FullyShardedDataParallel` argument (and value) with its FSDP2
equivalent, `fsdp2_equivalent(...)` writing the `fully_shard` calls for an FSDP1 configuration,
and DeepSpeed ZeRO-3's keys with theirs (`labkit.deepspeed.KEYS`' fsdp2 column).

    >>> for arg, value, fsdp2, why in FSDP1_TO_FSDP2: ...
    >>> print(fsdp2_equivalent("SHARD_GRAD_OP", param_dtype="bf16", cpu_offload=True))
    >>> deepspeed_zero3_rows()     # (DeepSpeed key, FSDP2 equivalent)

Checked against torch 2.13's signatures (listed above `FSDP1_TO_FSDP2`), the FSDP2 docs and the
tutorial's "FSDP1-to-FSDP2 migration guide". Pure data, no torch import.
"""
from __future__ import annotations

from labkit import validate
from labkit.deepspeed import KEYS

# Checked against torch 2.13: `FullyShardedDataParallel.__init__(module, process_group,
# sharding_strategy, cpu_offload, auto_wrap_policy, backward_prefetch, mixed_precision,
# ignored_modules, param_init_fn, device_id, sync_module_states, forward_prefetch,
# limit_all_gathers, use_orig_params, ignored_states, device_mesh)`, `ShardingStrategy`
# (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, _HYBRID_SHARD_ZERO2), `BackwardPrefetch`
# (BACKWARD_PRE, BACKWARD_POST), `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype, ...)`,
# `CPUOffload(offload_params)`; `fully_shard(module, *, mesh, reshard_after_forward,
# shard_placement_fn, mp_policy, offload_policy, ignored_params)`,
# `MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)`,
# `CPUOffloadPolicy(pin_memory)` and the `FSDPModule` methods; the FSDP2 docs
# (docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard) and the tutorial's
# "FSDP1-to-FSDP2 migration guide" (docs.pytorch.org/tutorials/intermediate/FSDP_tutorial.html).
#
# (FSDP1 argument, value, FSDP2 equivalent, why / how)
FSDP1_TO_FSDP2: tuple[tuple[str, str, str, str], ...] = (
    ("sharding_strategy", "ShardingStrategy.FULL_SHARD",
     "fully_shard(block, reshard_after_forward=True) per block, then fully_shard(model)",
     "ZeRO-3: gather before forward and again before backward (FSDP2's default; the root keeps "
     "its weights, reshard_after_forward=None)"),
    ("sharding_strategy", "ShardingStrategy.SHARD_GRAD_OP",
     "fully_shard(..., reshard_after_forward=False)",
     "ZeRO-2-like: weights stay gathered from forward to backward, no backward all-gather"),
    ("sharding_strategy", "ShardingStrategy.NO_SHARD",
     "no fully_shard equivalent: DistributedDataParallel",
     "nothing sharded, gradients all-reduced: that is DDP"),
    ("sharding_strategy", "ShardingStrategy.HYBRID_SHARD",
     "fully_shard(..., mesh=init_device_mesh(device, (replicas, shard), mesh_dim_names="
     "('replicate', 'shard')))",
     "HSDP: a 2-D mesh shards over the last dim and all-reduces over the first"),
    ("sharding_strategy", "ShardingStrategy._HYBRID_SHARD_ZERO2",
     "the 2-D mesh of HYBRID_SHARD with reshard_after_forward=False", "HSDP, ZeRO-2-like"),
    ("auto_wrap_policy", "ModuleWrapPolicy({Block}) / transformer_auto_wrap_policy",
     "call fully_shard on each block, then on the root (no policy argument)",
     "wrapping is explicit: each call makes one unit (one all-gather, one reduce-scatter)"),
    ("mixed_precision", "MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)",
     "mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)",
     "buffer_dtype has no equivalent: FSDP2 neither shards nor casts buffers (cast them "
     "yourself)"),
    ("use_orig_params", "True / False",
     "no equivalent needed: parameters are always the original ones (DTensor shards)",
     "FSDP2 has no FlatParameter; names, shapes and requires_grad are kept per parameter, so "
     "any optimizer and parameter groups work"),
    ("backward_prefetch", "BackwardPrefetch.BACKWARD_PRE",
     "the default (FSDP2 prefetches the next unit's all-gather in the backward); more with "
     "FSDPModule.set_modules_to_backward_prefetch([...])", "prefetch before the current "
     "unit's gradient computation"),
    ("backward_prefetch", "BackwardPrefetch.BACKWARD_POST",
     "no equivalent: FSDP2 always prefetches before the current unit's backward",
     "POST issued the next all-gather after the current gradients were computed (less "
     "memory, less overlap)"),
    ("forward_prefetch", "True",
     "block.set_modules_to_forward_prefetch([next_block]) for each block",
     "explicit forward prefetching (FSDP2 otherwise overlaps only implicitly)"),
    ("limit_all_gathers", "True",
     "no equivalent needed", "FSDP2 manages memory across streams without record_stream, so "
     "no rate limiter is needed for deterministic memory"),
    ("cpu_offload", "CPUOffload(offload_params=True)",
     "offload_policy=CPUOffloadPolicy(pin_memory=True)",
     "sharded params and grads on the host; the optimizer step runs on the CPU"),
    ("sync_module_states", "True",
     "no argument: load a full state dict with set_model_state_dict(model, sd, options="
     "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))",
     "or initialise with the same seed on every rank before fully_shard"),
    ("device_id", "torch.cuda.current_device()",
     "no argument: the mesh's device (init_device_mesh('cuda', ...)) places the shards",
     "fully_shard moves the parameters to the mesh's device"),
    ("ignored_modules", "[module, ...]",
     "ignored_params={p for m in modules for p in m.parameters()}",
     "ignored parameters are neither sharded nor reduced"),
    ("process_group / device_mesh", "group or DeviceMesh", "mesh=DeviceMesh",
     "FSDP2 takes a DeviceMesh only"),
)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", None)
DTYPES = {None: None, "fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}


def _dtype(name, value):
    if value not in DTYPES:
        raise ValueError(f"{name}={validate.describe(value)} is not supported; allowed: None, "
                         "'fp32', 'bf16', 'fp16'")
    return DTYPES[value]


def fsdp2_equivalent(sharding_strategy="FULL_SHARD", *, auto_wrap=True, param_dtype=None,
                     reduce_dtype=None, cpu_offload=False, forward_prefetch=False,
                     backward_prefetch="BACKWARD_PRE", replicas=None) -> str:
    """The FSDP2 code for an FSDP1 configuration: `FullyShardedDataParallel(model,
    sharding_strategy=ShardingStrategy.<sharding_strategy>, auto_wrap_policy=<per block if
    auto_wrap>, mixed_precision=MixedPrecision(param_dtype, reduce_dtype), cpu_offload=
    CPUOffload(offload_params=cpu_offload), forward_prefetch=..., backward_prefetch=...)`.
    HYBRID_SHARD needs `replicas` (the mesh's first dim). Raises ValueError for what FSDP2
    cannot express (NO_SHARD: use DDP; BACKWARD_POST)."""
    validate.choice("sharding_strategy", sharding_strategy, STRATEGIES)
    for name, value in (("auto_wrap", auto_wrap), ("cpu_offload", cpu_offload),
                        ("forward_prefetch", forward_prefetch)):
        validate.choice(name, value, (True, False))
    validate.choice("backward_prefetch", backward_prefetch, PREFETCH)
    pd, rd = _dtype("param_dtype", param_dtype), _dtype("reduce_dtype", reduce_dtype)
    if sharding_strategy == "NO_SHARD":
        raise ValueError("sharding_strategy='NO_SHARD' has no fully_shard equivalent: nothing "
                         "is sharded; use DistributedDataParallel(model)")
    if backward_prefetch == "BACKWARD_POST":
        raise ValueError("backward_prefetch='BACKWARD_POST' has no FSDP2 equivalent: FSDP2 "
                         "prefetches before each unit's backward; allowed: 'BACKWARD_PRE', None")
    if forward_prefetch and not auto_wrap:
        raise ValueError("forward_prefetch=True prefetches the next unit: it needs "
                         "auto_wrap=True (one unit per block)")
    hybrid = "HYBRID" in sharding_strategy
    if hybrid:
        replicas = validate.positive_int("replicas", replicas, validate.MAX_RANKS)
    elif replicas is not None:
        raise ValueError(f"replicas={validate.describe(replicas)} is only for HYBRID_SHARD and "
                         "_HYBRID_SHARD_ZERO2; leave it None")
    args = []
    if hybrid:
        args.append("mesh=mesh")
    if sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"):
        args.append("reshard_after_forward=False")
    if pd or rd:
        args.append(f"mp_policy=MixedPrecisionPolicy(param_dtype={pd}, reduce_dtype={rd})")
    if cpu_offload:
        args.append("offload_policy=CPUOffloadPolicy()")
    kw = "".join(", " + a for a in args)
    lines = (["import torch"] if pd or rd else []) + [
        "from torch.distributed.fsdp import fully_shard"
             + (", MixedPrecisionPolicy" if pd or rd else "")
             + (", CPUOffloadPolicy" if cpu_offload else "")]
    if hybrid:
        lines += ["from torch.distributed.device_mesh import init_device_mesh",
                  f"mesh = init_device_mesh('cuda', ({replicas}, world_size // {replicas}), "
                  "mesh_dim_names=('replicate', 'shard'))"]
    if auto_wrap:
        lines += ["for block in blocks:                 # e.g. model.model.layers",
                  f"    fully_shard(block{kw})"]
    lines.append(f"fully_shard(model{kw})")
    if forward_prefetch:
        lines += ["for block, after in zip(blocks, blocks[1:]):",
                  "    block.set_modules_to_forward_prefetch([after])"]
    return "\n".join(lines)


def deepspeed_zero3_rows() -> list[tuple[str, str]]:
    """(DeepSpeed ZeRO-3 key, FSDP2 equivalent) from `labkit.deepspeed.KEYS`."""
    return [(k.key, k.fsdp2) for k in KEYS if 3 in k.stages]
