"""Answers of the ZeRO and FSDP questions (labkit/quiz/data/zero_fsdp.yaml), computed with
labkit.memory, labkit.comm, labkit.fsdp, labkit.fsdp_migrate and labkit.deepspeed. Two verify
functions read torch's own API (imported when called, never at module level): whether an FSDP2
method or a DCP function exists is a fact about torch, and torch is the primary source."""
from __future__ import annotations

import math

from labkit.comm import step_communication
from labkit.deepspeed import PIPELINE_ZERO_STAGES, check_pipeline
from labkit.fsdp import fsdp_communication, fsdp_memory
from labkit.fsdp_migrate import FSDP1_TO_FSDP2
from labkit.hardware import GPUS
from labkit.memory import estimate_memory
from labkit.models import get_model

GB = 1e9


def zero_states_gb(params_b, stage, dp, precision="bf16-mixed", optimizer="adamw"):
    """Model states per GPU in GB for a params_b-billion-parameter model at ZeRO-stage over dp,
    with each term and the figure a 12-byte count (no master weights) would give."""
    m = estimate_memory(params_b * 1e9, precision=precision, optimizer=optimizer,
                        zero_stage=stage, dp=dp)
    n = params_b * 1e9
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[stage]
    twelve = (2 * n / shard[0] + 2 * n / shard[1] + 8 * n / shard[2]) / GB
    return {"answer": m.model_states / GB, "params_gb": m.params / GB, "grads_gb": m.grads / GB,
            "opt_gb": m.optimizer_states / GB, "twelve_gb": twelve,
            "full_gb": 16 * n / GB, "per_gpu_if_all_sharded": 16 * n / dp / GB}


def zero3_states_and_activations(params_b, dp, seed_states_gb):
    """ZeRO-3 model states per GPU, GB, and what a count of 14 B/param without master weights
    (2 + 4 + 8) gives."""
    out = zero_states_gb(params_b, 3, dp)
    return {**out, "fourteen_gb": 14 * params_b / dp, "seed_states_gb": seed_states_gb}


def comm_ratio(strategy, dp, microbatches=1, baseline="ddp", params_b=7):
    """Bytes per rank per step of `strategy` / those of `baseline` (both from
    labkit.comm.step_communication, bf16 weights and gradients)."""
    def sent(s):
        return step_communication(s, num_params=params_b * 1e9, dp=dp, param_bytes=2,
                                  grad_bytes=2, microbatches=microbatches)
    a, b = sent(strategy), sent(baseline)
    return {"answer": a.total_bytes / b.total_bytes, "gb": a.total_bytes / GB,
            "base_gb": b.total_bytes / GB,
            "ops": ", ".join(f"{n} {op}" for op, (n, _) in a.by_op.items()),
            "base_ops": ", ".join(f"{n} {op}" for op, (n, _) in b.by_op.items())}


def zero2_same_as_ddp(params_b, dp):
    """ZeRO-2 (reduce-scatter + all-gather) sends exactly DDP's all-reduce bytes."""
    r = comm_ratio("zero2", dp, params_b=params_b)
    return {"holds": math.isclose(r["answer"], 1.0), **r}


def fsdp_collectives_per_layer(layers, dp):
    """Per wrapped layer (unit) of ZeRO-3 / FSDP: all-gathers and reduce-scatters per step."""
    c = step_communication("fsdp", num_params=layers * 1e8, dp=dp, units=layers)
    ag, rs = c.by_op["all_gather"][0] / layers, c.by_op["reduce_scatter"][0] / layers
    ratio = c.total_bytes / step_communication("ddp", num_params=layers * 1e8, dp=dp,
                                               grad_bytes=4).total_bytes
    return {"holds": ag == 2 and rs == 1, "ag": ag, "rs": rs, "ratio": ratio}


def min_dp_zero3(model, gpu, stage=3):
    """Smallest data-parallel degree whose ZeRO-`stage` model states fit in one GPU's memory."""
    n = get_model(model).num_params()
    mem = GPUS[gpu].memory
    dp = 1
    while estimate_memory(n, zero_stage=stage, dp=dp).model_states > mem:
        dp += 1
    return {"answer": dp, "params_b": n / 1e9, "states_tb": 16 * n / 1e12, "memory_gb": mem / GB,
            "per_gpu_gb": estimate_memory(n, zero_stage=stage, dp=dp).model_states / GB}


def deepspeed_pipeline_refuses(stage, microbatches, dp):
    """DeepSpeed's PipelineEngine accepts ZeRO 0 and 1 only; with m micro-batches, ZeRO-3's data
    traffic per step would be m times its one-micro-batch traffic."""
    try:
        check_pipeline(stage)
        refused = False
    except ValueError:
        refused = True
    ok_stage1 = check_pipeline(1) == 1
    z3 = comm_ratio("zero3", dp, microbatches=microbatches, baseline="zero1")
    z3_once = comm_ratio("zero3", dp, microbatches=1, baseline="zero1")
    return {"holds": refused and ok_stage1, "allowed": ", ".join(map(str, PIPELINE_ZERO_STAGES)),
            "times": z3["answer"] / z3_once["answer"]}


def reshard_trade_off(model, dp):
    """FSDP2 reshard_after_forward=False: no backward all-gathers (fewer bytes), but every
    block's unsharded weights are held from forward to backward (more memory)."""
    on = fsdp_communication(model, dp, param_dtype="bf16")
    off = fsdp_communication(model, dp, param_dtype="bf16", reshard_after_forward=False)
    m_on = fsdp_memory(model, dp, param_dtype="bf16")
    m_off = fsdp_memory(model, dp, param_dtype="bf16", reshard_after_forward=False)
    return {"holds": off.total_bytes < on.total_bytes and m_off.unsharded_held > m_on.unsharded_held,
            "bytes_ratio": off.total_bytes / on.total_bytes,
            "held_on_gb": m_on.unsharded_held / GB, "held_off_gb": m_off.unsharded_held / GB}


def wrap_changes_peak_not_bytes(model, dp):
    """Per-block wrapping vs one whole-model FSDP unit: bytes nearly equal, gathered peak far
    smaller."""
    block = fsdp_communication(model, dp).total_bytes
    whole = fsdp_communication(model, dp, per_block=False).total_bytes
    peak_b = fsdp_memory(model, dp).unsharded_peak
    peak_w = fsdp_memory(model, dp, per_block=False).unsharded_peak
    return {"holds": abs(block / whole - 1) < 0.05 and peak_b / peak_w < 0.25,
            "bytes_ratio": block / whole, "peak_ratio": peak_b / peak_w}


def no_use_orig_params(flag):
    """FSDP2 has no use_orig_params: labkit.fsdp_migrate's row for it says no equivalent is
    needed; torch's fully_shard signature confirms it."""
    import inspect

    from torch.distributed.fsdp import fully_shard
    row = next(r for r in FSDP1_TO_FSDP2 if r[0] == flag)
    args = inspect.signature(fully_shard).parameters
    return {"holds": flag not in args and row[2].startswith("no equivalent"), "fsdp2": row[2],
            "args": ", ".join(a for a in args if a != "module")}


def fsdp2_prefetch_api(name):
    """Whether torch's FSDPModule has a method `name`, and its prefetch methods."""
    from torch.distributed.fsdp import FSDPModule
    methods = sorted(m for m in dir(FSDPModule) if "prefetch" in m and not m.startswith("_"))
    return {"holds": not hasattr(FSDPModule, name) and bool(methods),
            "methods": ", ".join(methods)}


def dcp_save_blocks():
    """torch.distributed.checkpoint has a blocking save and a separate async_save."""
    import inspect

    import torch.distributed.checkpoint as dcp
    return {"holds": hasattr(dcp, "async_save") and inspect.isfunction(dcp.save),
            "async_args": ", ".join(list(inspect.signature(dcp.async_save).parameters)[:3])}
