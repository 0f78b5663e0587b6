"""DeepSpeed's ZeRO configuration as data: each `zero_optimization` key of stages 1-3 and offload,
what labkit's ZeRO (`labkit.parallel.zero`) and FSDP2's closest option (`fully_shard`) do
instead; a builder for the JSON config; why DeepSpeed's pipeline engine takes only ZeRO-0/1.

    >>> deepspeed_config(3, offload_optimizer=True, offload_param=True)   # a dict, json.dumps it
    >>> key_rows()            # (key, stages, default, what it does, labkit, FSDP2) per key
    >>> unset_value("overlap_comm", 3)   # what DeepSpeed's code uses when the key is left out
    >>> check_pipeline(2)     # ValueError quoting DeepSpeed's PipelineEngine

Sources: DeepSpeed's docs (`DEEPSPEED_DOCS`) and, where they differ, its code (`DEEPSPEED_CODE`);
torch 2.13's `fully_shard` and `FSDPModule` (above `KEYS`). Pure data, no torch or deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass
import numbers

from labkit import validate

DEEPSPEED_DOCS = ("DeepSpeed, docs/_pages/config-json.md (https://www.deepspeed.ai/docs/"
                  "config-json/), github.com/deepspeedai/DeepSpeed")
DEEPSPEED_CODE = ("DeepSpeed, deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig: the "
                  "overlap_comm_valid and offload_ratio_check validators, prefetch_bucket_size's "
                  "Field) and offload_config.py")
PIPELINE_SOURCE = "deepspeed/runtime/pipe/engine.py, PipelineEngine.__init__"
PIPELINE_ASSERT = ('assert self.zero_optimization_stage() < ZeroStageEnum.gradients, '
                   '"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"')
PIPELINE_ZERO_STAGES = (0, 1)
PIPELINE_WHY = (
    "DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3 at construction: "
    f"`{PIPELINE_ASSERT}` ({PIPELINE_SOURCE}). The pipeline engine schedules the gradient "
    "all-reduce itself, once, after the last micro-batch (it sets enable_backward_allreduce = "
    "False and reduces in _exec_reduce_grads), so each stage accumulates whole gradients over "
    "its micro-batches. ZeRO-2 keeps only a 1/dp gradient shard and must reduce-scatter after "
    "every micro-batch's backward, and ZeRO-3 must all-gather every weight before each "
    "micro-batch's forward and backward: with m micro-batches in flight that is m times the "
    "data-parallel traffic per step (labkit.comm.step_communication('zero2'/'zero3', "
    "microbatches=m)). ZeRO-1 shards only the optimizer states, used once per step, so it "
    "composes with the pipeline at no extra communication.")
OFFLOAD_DEVICES = ("cpu", "nvme")
PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Key:
    key: str          # path in "zero_optimization" ("offload_optimizer.device"), or top level
    stages: tuple     # ZeRO stages it applies to
    default: object   # DeepSpeed's documented default
    does: str         # what DeepSpeed does with it
    labkit: str       # what labkit.parallel.zero does ("not modelled: ..." when nothing)
    fsdp2: str        # the closest FSDP2 option
    code_default: object = None   # DeepSpeed's code, where it differs from the docs: a value,
                                  # or {stage: value}


_S3 = (3,)
_ALL = (1, 2, 3)
# Key names, defaults and descriptions are DeepSpeed's configuration reference (DEEPSPEED_DOCS:
# sections "ZeRO Optimizations for FP16 Training", "Parameter offloading", "Optimizer
# offloading"). FSDP2's options are torch 2.13's `fully_shard(module, *, mesh,
# reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, ignored_params)` and the
# `FSDPModule` methods.
KEYS: tuple[Key, ...] = (
    Key("stage", (0, 1, 2, 3), 0,
        "0 off; 1 partitions optimizer states; 2 also gradients; 3 also parameters",
        "1: ShardedOptimizer(params, optimizer_class, **defaults); 2: ShardedGradientOptimizer "
        "(same arguments); 3: FullyShardedModel(module, compute_dtype, shard)",
        "fully_shard(...) is stage 3; reshard_after_forward=False is stage-2-like (weights kept "
        "gathered from forward to backward); stage 1 has no FSDP2 form (torch's "
        "ZeroRedundancyOptimizer)"),
    Key("reduce_scatter", (1, 2), True,
        "reduce-scatter (or reduce) instead of all-reduce to average gradients",
        "ShardedGradientOptimizer and FullyShardedModel reduce-scatter (sum / N); "
        "ShardedOptimizer expects averaged gradients (after DDP's all-reduce) unless "
        "reduce_gradients=True, which reduce-scatters as DeepSpeed's stage 1 does",
        "always reduce-scatter within a fully_shard unit; an all-reduce only across HSDP's "
        "replicate dimension (FSDPModule.set_requires_all_reduce)"),
    Key("allgather_partitions", (1, 2), True,
        "one all-gather (else a series of broadcasts) of the updated weights after the step",
        "ShardedOptimizer.step() ends with one all-gather of the flat buffer",
        "always all-gather (in the next forward, not after the step)"),
    Key("allgather_bucket_size", (1, 2), 5e8,
        "elements all-gathered at a time (bounds the buffer of the all-gather)",
        "not modelled: one all-gather of the whole flat buffer per step",
        "no size option: each fully_shard unit's parameters are one all-gather"),
    Key("overlap_comm", _ALL, False,
        "overlap gradient reduction with the backward (and, with offload, the GPU->CPU copy); "
        "left out, DeepSpeed's code sets it to stage == 3 (overlap_comm_valid): on at stage 3",
        "not modelled: collectives are synchronous (module 03's OverlappedDDP shows how)",
        "always on: collectives run on separate streams beside compute",
        code_default={1: False, 2: False, 3: True}),
    Key("reduce_bucket_size", _ALL, 5e8,
        "elements reduced at a time (bounds the gradient bucket)",
        "not modelled: ShardedGradientOptimizer reduce-scatters all gradients as one bucket; "
        "FullyShardedModel one collective per parameter of a sharded module",
        "no size option: each fully_shard unit's gradients are one reduce-scatter; the wrapping "
        "sets the bucket"),
    Key("contiguous_gradients", _ALL, True,
        "copy gradients into one contiguous buffer as they are produced (less fragmentation)",
        "ShardedGradientOptimizer copies each gradient into one flat buffer as it arrives and "
        "frees it (the same idea, one bucket)",
        "no option (FSDP2 copies into a reduce-scatter input buffer itself)"),
    Key("round_robin_gradients", (1, 2), False,
        "with CPU offload, spread the gradient copies to the CPU over ranks",
        "not modelled", "no equivalent"),
    Key("sub_group_size", _S3, 1e9,
        "parameters per tile of the optimizer step (bounds its temporary buffers)",
        "not modelled: the local optimizer steps the whole shard (one Parameter)",
        "no equivalent: torch.optim steps the DTensor shards"),
    Key("stage3_prefetch_bucket_size", _S3, 5e8,
        "elements of the buffer that prefetches parameters before they are needed (the docs say "
        "5e8; the code's default, Field(pp_int(5e7)), is 10x smaller)",
        "not modelled: each module is all-gathered just before its forward and its backward",
        "the next unit's all-gather is prefetched by default; "
        "FSDPModule.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch for more",
        code_default=5e7),
    Key("stage3_param_persistence_threshold", _S3, 1e5,
        "parameters smaller than this are not partitioned (kept whole on every rank)",
        "by type, not size: modules not in shard=(nn.Linear, nn.Embedding) stay replicated with "
        "all-reduced gradients",
        "no threshold: small modules are left to an enclosing unit (often the root, whose "
        "reshard_after_forward defaults to False)"),
    Key("stage3_max_live_parameters", _S3, 1e9,
        "most gathered parameters resident per GPU before they are released",
        "one module's gathered weights at a time (freed after its forward and its backward)",
        "no count: reshard_after_forward=True frees each unit after its forward; prefetching "
        "keeps about two units gathered"),
    Key("stage3_max_reuse_distance", _S3, 1e9,
        "do not release a parameter that will be reused within this many parameters",
        "not modelled: always freed and gathered again for the backward",
        "reshard_after_forward=False keeps a unit gathered from its forward to its backward"),
    Key("stage3_gather_16bit_weights_on_model_save", _S3, False,
        "gather the partitioned 16-bit weights into one state dict when saving",
        "gather_full_params() returns {name: full tensor}",
        "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
        "options=StateDictOptions(full_state_dict=True, cpu_offload=True))"),
    Key("offload_optimizer.device", _ALL, "cpu",
        "optimizer states (and the step) on the CPU ('cpu') or in NVMe ('nvme', stage 3 only); "
        "the step always runs on the CPU",
        "not modelled on ranks; costed: labkit.memory.estimate_memory(offload='optimizer'), "
        "labkit.offload.offload_cost",
        "no optimizer-only offload: offload_policy=CPUOffloadPolicy() moves parameters, "
        "gradients and the optimizer step to the CPU together"),
    Key("offload_optimizer.pin_memory", _ALL, True,
        "page-locked host memory, for asynchronous full-bandwidth copies (default false before "
        "DeepSpeed changed it)",
        "not modelled", "CPUOffloadPolicy(pin_memory=True)"),
    Key("offload_optimizer.ratio", _S3, 1,
        "share of the parameters whose optimizer step runs on the CPU; below 1 only at stage 3 "
        "(offload_ratio_check: \"Partial offloading only supported for ZeRO Stage 3.\"); 1, "
        "everything, at any stage with offload",
        "not modelled", "no equivalent (all or nothing)"),
    Key("offload_param.device", _S3, "cpu",
        "parameter shards in CPU memory ('cpu') or NVMe ('nvme'); stage 3 only",
        "not modelled on ranks; costed: estimate_memory(offload='params'), offload_cost",
        "offload_policy=CPUOffloadPolicy()"),
    Key("offload_param.pin_memory", _S3, True,
        "page-locked host memory for the parameter shards",
        "not modelled", "CPUOffloadPolicy(pin_memory=True)"),
    Key("bf16.enabled / fp16.enabled (top level)", (0, 1, 2, 3), False,
        "16-bit weights for compute with fp32 master weights in the optimizer (fp16 with loss "
        "scaling)",
        "FullyShardedModel(compute_dtype=torch.bfloat16): 16-bit all-gather and compute, fp32 "
        "master shards, gradients and optimizer",
        "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"),
)


def _value(v) -> str:
    """5e8 for 500000000.0; anything else as str."""
    if isinstance(v, float) and v >= 1e4 and v == int(v):
        mantissa, exponent = f"{v:e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    return str(v)


def _default_text(k: Key) -> str:
    if k.code_default is None:
        return _value(k.default)
    code = k.code_default
    if isinstance(code, dict):
        by_value: dict = {}
        for stage, v in code.items():
            by_value.setdefault(v, []).append(str(stage))
        text = "; ".join(f"{_value(v)} at stage{'s' * (len(st) > 1)} {', '.join(st)}"
                         for v, st in by_value.items())
    else:
        text = _value(code)
    return f"docs: {_value(k.default)}; code: {text}"


def key_rows() -> list[tuple]:
    """The table, one row per key: (key, stages, default, does, labkit, FSDP2); the default
    column gives the docs' value and, where it differs, the code's."""
    return [(k.key, ", ".join(str(s) for s in k.stages), _default_text(k), k.does, k.labkit,
             k.fsdp2) for k in KEYS]


def unset_value(key: str, stage):
    """What DeepSpeed's code uses for `key` left out of a stage-`stage` config (DEEPSPEED_CODE
    where it differs from the docs, else the documented default)."""
    stage = _stage(stage)
    found = {k.key: k for k in KEYS}.get(key)
    if found is None or stage not in found.stages:
        allowed = ", ".join(k.key for k in KEYS if stage in k.stages)
        raise ValueError(f"key={validate.describe(key)} is not a ZeRO key of stage {stage}; "
                         f"allowed: {allowed}")
    code = found.code_default
    if isinstance(code, dict):
        return code[stage]
    return found.default if code is None else code


def _device(name: str, value) -> str | None:
    """False/None -> None (no offload), True -> "cpu", "cpu"/"nvme" as given."""
    if value is None or value is False:
        return None
    if value is True:
        return "cpu"
    if isinstance(value, str) and value in OFFLOAD_DEVICES:
        return value
    raise ValueError(f"{name}={validate.describe(value)} is not supported; allowed: False, True "
                     "(= 'cpu'), 'cpu', 'nvme'")


def _stage(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in range(4):
        raise ValueError(f"stage={validate.describe(value)} is not a ZeRO stage; allowed: 0, 1, "
                         "2, 3")
    return int(value)


def _elements(name: str, value) -> int:
    return int(validate.positive(name, value, validate.MAX_PARAMS))


def deepspeed_config(stage, offload_optimizer=False, offload_param=False, *, precision="bf16",
                     micro_batch_size=1, gradient_accumulation_steps=1, overlap_comm=True,
                     contiguous_gradients=True, reduce_bucket_size=5e8,
                     allgather_bucket_size=5e8, prefetch_bucket_size=5e7,
                     param_persistence_threshold=1e5, pin_memory=True,
                     nvme_path="/local_nvme") -> dict:
    """A DeepSpeed config (a dict for json.dump) for ZeRO `stage` 0-3 with the keys of
    `KEYS` that apply to it. offload_optimizer / offload_param: False, True ("cpu"), "cpu" or
    "nvme". Rules (DEEPSPEED_DOCS): optimizer offload needs stage >= 1 ("CPU offloading is
    available with ZeRO stage 1, 2, 3"), to NVMe stage 3 ("NVMe offloading is available only
    with ZeRO stage 3"); parameter offload needs stage 3 ("Available only with ZeRO stage 3").
    Bucket sizes and the threshold are in elements, as DeepSpeed counts them; the defaults are
    what DeepSpeed's code uses when a key is left out (`unset_value`: prefetch 5e7, not the
    docs' 5e8)."""
    stage = _stage(stage)
    validate.choice("precision", precision, PRECISIONS)
    opt = _device("offload_optimizer", offload_optimizer)
    par = _device("offload_param", offload_param)
    if opt and stage < 1:
        raise ValueError(f"offload_optimizer={offload_optimizer!r} needs stage >= 1 (the CPU "
                         "steps this rank's partition of the optimizer states); got "
                         f"stage={stage}; allowed: 1, 2, 3")
    if opt == "nvme" and stage != 3:
        raise ValueError(f"offload_optimizer='nvme' needs stage=3 (DeepSpeed: NVMe offloading is "
                         f"available only with ZeRO stage 3); got stage={stage}; use 'cpu'")
    if par and stage != 3:
        raise ValueError(f"offload_param={offload_param!r} needs stage=3 (only partitioned "
                         f"parameters can live off the GPU); got stage={stage}; allowed: 3")
    validate.choice("overlap_comm", overlap_comm, (False, True))
    validate.choice("contiguous_gradients", contiguous_gradients, (False, True))
    validate.choice("pin_memory", pin_memory, (False, True))
    if (opt == "nvme" or par == "nvme") and not (isinstance(nvme_path, str) and nvme_path):
        raise ValueError(f"nvme_path={validate.describe(nvme_path)} must be a directory path "
                         "(text) on an NVMe drive, e.g. '/local_nvme'")
    zero: dict = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=overlap_comm, contiguous_gradients=contiguous_gradients,
                    reduce_bucket_size=_elements("reduce_bucket_size", reduce_bucket_size))
    if stage in (1, 2):
        zero.update(reduce_scatter=True, allgather_partitions=True,
                    allgather_bucket_size=_elements("allgather_bucket_size",
                                                    allgather_bucket_size))
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=_elements("prefetch_bucket_size",
                                                          prefetch_bucket_size),
                    stage3_param_persistence_threshold=_elements(
                        "param_persistence_threshold", param_persistence_threshold),
                    stage3_gather_16bit_weights_on_model_save=True)
    for section, device in (("offload_optimizer", opt), ("offload_param", par)):
        if device:
            zero[section] = {"device": device, "pin_memory": pin_memory,
                             **({"nvme_path": nvme_path} if device == "nvme" else {})}
    config = {"train_micro_batch_size_per_gpu": validate.positive_int(
                  "micro_batch_size", micro_batch_size, validate.MAX_BATCH),
              "gradient_accumulation_steps": validate.positive_int(
                  "gradient_accumulation_steps", gradient_accumulation_steps,
                  validate.MAX_BATCH),
              "zero_optimization": zero}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def check_pipeline(stage) -> int:
    """The ZeRO stage if DeepSpeed's pipeline engine takes it (0 or 1), else a ValueError
    quoting the engine's assertion and saying why (PIPELINE_WHY)."""
    stage = _stage(stage)
    if stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(f"stage={stage} with pipeline parallelism: {PIPELINE_WHY} Allowed with "
                         "the pipeline engine: 0, 1")
    return stage
