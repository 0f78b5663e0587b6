"""Reference answers that the check cells of solutions/ compare with, computed at run time.

They are the answers, so the check cells call them by name and never spell them out, and an
exercise that calls one is refused by the grader (labkit.course.forbid forbids this module to
every exercise). Each follows the exercise of the same name in its module's solutions notebook.

The cost models they call are imported here, when the grading kernel loads this module before
any answer runs, so labkit.course.seal records them and puts back anything an answer changes in
them (`labkit.memory.bytes_per_param`, `labkit.comm.collective_time`, ...). transformers and
torch stay inside the functions that need them.
"""
from __future__ import annotations

import functools
import math

from labkit import (comm, flops, hardware, memory, models, pipeline, planner, resilience,
                    scaling)

# ----------------------------------------------------------------------- 01 memory math

LLAMA_CASES = ("llama2-7b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", "debug")


def model_state_bytes(precision: str, optimizer: str) -> int:
    return memory.bytes_per_param(precision, optimizer)


def llama_configs(names=LLAMA_CASES) -> list:
    """transformers LlamaConfigs of labkit presets, each printing as its model's name."""
    import transformers

    class NamedConfig(transformers.LlamaConfig):
        def __repr__(self):
            return f"<LlamaConfig of {self.name_or_path}>"

    return [NamedConfig.from_dict(models.get_model(n).to_hf_config().to_dict(), name_or_path=n)
            for n in names]


def llama_layer_params(config) -> int:
    """transformers' own LlamaDecoderLayer for `config`, built on the meta device and counted."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, layer_idx=0)
    return sum(p.numel() for p in layer.parameters())


def activation_bytes(seq_len, batch_size, hidden_size, num_heads, recompute="none") -> float:
    return memory.activation_bytes_per_layer(seq_len=seq_len, batch_size=batch_size,
                                      hidden_size=hidden_size, num_heads=num_heads,
                                      recompute=recompute)


def min_gpus_zero3(model: str, gpu: str, seq_len: int, recompute: str = "full") -> int:
    """dp = 1, 2, 3, ... until labkit's estimate fits; ValueError when none up to 1e5 does and
    the activations alone exceed the GPU."""
    def estimate(dp):
        return memory.estimate_memory(model, batch_size=1, seq_len=seq_len, zero_stage=3, dp=dp,
                               recompute=recompute)

    if estimate(1).activations >= hardware.GPUS[gpu].memory:
        raise ValueError(f"{model} at {seq_len} tokens: the activations alone exceed {gpu}")
    for dp in range(1, 100_000):
        if estimate(dp).fits(gpu):
            return dp
    raise ValueError(f"{model} does not fit on {gpu} at any dp")


def activations_alone(model: str, seq_len: int, recompute: str) -> float:
    return memory.estimate_memory(model, seq_len=seq_len, recompute=recompute).activations


# ----------------------------------------------------------------------- 02 collectives

def ring_all_reduce_time(nbytes, world_size, bandwidth, latency) -> float:
    return comm.collective_time("all_reduce", nbytes, world_size, bandwidth, latency)


def ddp_all_reduce_time() -> float:
    """Seconds of DDP's all-reduce of 7B bf16 gradients on 8 GPUs over NVLink 4."""
    nv = hardware.LINKS["nvlink4"]
    return ring_all_reduce_time(2 * 7e9, 8, nv.bandwidth, nv.latency)


def busbw(op, nbytes, seconds, world_size) -> float:
    return comm.bus_bandwidth(op, nbytes, seconds, world_size)


NCCL_LINE = "   268435456       8388608     float    none      -1    652.5       ?       ?"


def read_busbw(line: str = NCCL_LINE) -> tuple[float, float]:
    """(busbw in GB/s, share of NVLink 4 per direction) of an all_gather_perf line on 8 GPUs."""
    fields = line.split()
    value = busbw("all_gather", int(fields[0]), float(fields[5]) * 1e-6, 8)
    return value / 1e9, value / hardware.LINKS["nvlink4"].bandwidth


# ----------------------------------------------------------------------- 03 DDP

def bucket_assignment(sizes, bucket_size_mb: float = 25.0) -> list[list[int]]:
    """labkit's BucketedDDP packing of parameter sizes (bytes, registration order) into buckets."""
    from labkit.parallel import ddp

    return ddp.assign_buckets(list(sizes), bucket_size_mb)


def sampler_indices(dataset_len, num_replicas, rank, epoch=0, shuffle=True, drop_last=False,
                    seed=0) -> list[int]:
    """The indices torch's own DistributedSampler gives `rank` in `epoch` (after set_epoch)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def ddp_step_time(num_params, gpus, bandwidth, latency, compute_seconds, bucket_size_mb=25.0,
                  grad_bytes=4) -> float:
    """Seconds of a DDP step with no overlap: compute + every bucket's ring all-reduce."""
    return scaling.ddp_step_time(num_params, gpus, None, compute_seconds=compute_seconds,
                                 bandwidth=bandwidth, latency=latency, grad_bytes=grad_bytes,
                                 bucket_size_mb=bucket_size_mb, overlap=0.0).total


def ddp_7b_step(gpus: int = 64, link: str = "ib-ndr", compute_seconds: float = 2.0) -> float:
    """Exercise step_time's question: 7B parameters, bf16 gradients, 25 MiB buckets."""
    L = hardware.LINKS[link]
    return ddp_step_time(7e9, gpus, L.bandwidth, L.latency, compute_seconds, grad_bytes=2)


def throughput_loss(step_time_increase) -> float:
    return scaling.throughput_loss(step_time_increase)


# ----------------------------------------------------------------------- 04 ZeRO

ZERO_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")      # stage 0 is DDP


def partition(sizes, world_size) -> list[list[int]]:
    """torch's ZeroRedundancyOptimizer's partition (labkit's partition_parameters): parameters
    from the largest to the smallest, each to the least-loaded rank; indices ascending per rank."""
    from labkit.parallel import zero

    return zero.partition_parameters(list(sizes), world_size)


def zero_bytes(num_params, stage, dp) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per GPU: bf16-mixed AdamW, ZeRO `stage`."""
    m = memory.estimate_memory(num_params, zero_stage=stage, dp=dp)
    return m.params, m.grads, m.optimizer_states


def zero_comm(num_params, stage, dp, nbytes=2) -> float:
    """Bytes one rank sends per step (ring algorithms) under ZeRO `stage` (0 = DDP)."""
    return comm.step_communication(ZERO_STRATEGIES[stage], num_params=num_params, dp=dp,
                                   param_bytes=nbytes, grad_bytes=nbytes).total_bytes


def min_gpus(num_params, stage, gpu_bytes) -> int:
    """The smallest dp whose per-GPU model states (bf16-mixed AdamW) fit in `gpu_bytes`: the
    states shrink as dp grows, so a doubling then a bisection over estimate_memory; ValueError
    when even validate.MAX_RANKS GPUs do not fit."""
    from labkit import validate

    def fits(dp):
        return memory.estimate_memory(num_params, zero_stage=stage, dp=dp).model_states <= gpu_bytes

    if not fits(validate.MAX_RANKS):
        raise ValueError(f"{num_params:g} parameters at ZeRO-{stage} fit on no number of GPUs")
    return _fewest(fits)


def _fewest(fits) -> int:
    """The smallest n >= 1 with fits(n), for a fits that stays true once true: a doubling, then
    a bisection."""
    hi = 1
    while not fits(hi):
        hi *= 2
    lo = hi // 2                  # does not fit (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


# ----------------------------------------------------------------------- 05 FSDP

def job_mtbf(gpus, daily_failure_rate) -> float:
    """Seconds between failures of a job on `gpus` GPUs, each failing at `daily_failure_rate`
    a day: one day / (gpus x rate)."""
    return resilience.job_mtbf(gpus, daily_failure_rate)


def checkpoint_interval(mtbf, write_time) -> float:
    """Young's optimal seconds of work between checkpoints: sqrt(2 x write_time x mtbf)."""
    return resilience.young_daly_interval(mtbf, write_time)


# ----------------------------------------------------------------------- 06 tensor parallelism

TP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def tp_collectives(layers, recompute="none", sequence_parallel=False) -> dict[str, int]:
    """{kind: count} of the tensor-parallel collectives of one step (one micro-batch) of a model
    with `layers` transformer layers, Megatron's way (labkit.comm.step_communication("tp"))."""
    spec = models.get_model("debug-llama").with_(num_layers=layers)
    payload = comm.step_communication("tp", model=spec, tp=2, recompute=recompute,
                                      sequence_parallel=sequence_parallel).payload
    return {kind: payload.get(kind, (0, 0))[0] for kind in TP_KINDS}


def tp_step_gb(model="llama2-70b", tp=8, batch_size=1, seq_len=4096) -> float:
    """GB one rank sends per step for tensor parallelism (ring algorithms, bf16 activations)."""
    return comm.step_communication("tp", model=model, tp=tp, batch_size=batch_size,
                                   seq_len=seq_len).total_bytes / 1e9


def tp_activation_bytes(seq_len, batch_size, hidden_size, num_heads, tp=1,
                        sequence_parallel=False) -> float:
    """Korthikanti et al.'s activation bytes per layer on one tensor-parallel rank."""
    return memory.activation_bytes_per_layer(seq_len=seq_len, batch_size=batch_size,
                                             hidden_size=hidden_size, num_heads=num_heads,
                                             tp=tp, sequence_parallel=sequence_parallel)


# ----------------------------------------------------------------------- 07 pipeline parallelism

def pp_events(schedule, stages, microbatches, chunks=1, shift=0.0, by_rank=False) -> list[dict]:
    """labkit's simulated events as the dicts a measured run reports (labkit.parallel.pipe),
    every time moved by `shift` seconds; by_rank: listed rank by rank, as gathered from the
    ranks, not in time order."""
    events = pipeline.simulate(schedule, stages, microbatches, chunks=chunks).events
    if by_rank:
        events = sorted(events, key=lambda e: e.stage)
    return [{"stage": e.stage, "kind": e.kind, "microbatch": e.microbatch, "chunk": e.chunk,
             "start": e.start + shift, "end": e.end + shift} for e in events]


def pp_idle_share(events) -> float:
    """Idle share of a step from its events (labkit.pipeline.idle_share)."""
    return pipeline.idle_share(events)


def pp_bubble(schedule, stages, microbatches, chunks=1) -> tuple[float, float]:
    """(idle share of the step, bubble relative to the ideal time), simulated."""
    r = pipeline.simulate(schedule, stages, microbatches, chunks=chunks)
    return r.bubble_fraction, r.bubble_ratio


def pp_min_microbatches(stages, target, chunks=1) -> int:
    """The fewest micro-batches whose simulated idle share is at most `target` (1F1B, or
    interleaved 1F1B with `chunks` > 1, m then a multiple of stages): a bisection over the
    simulator (the share falls as m grows)."""
    step = stages if chunks > 1 else 1
    schedule = "interleaved-1f1b" if chunks > 1 else "1f1b"

    def fits(k):
        share = pipeline.simulate(schedule, stages, k * step, chunks=chunks).bubble_fraction
        return share <= target * (1 + 1e-12)

    return _fewest(fits) * step


def pp_1f1b_order(stage, stages, microbatches) -> list[tuple[str, int]]:
    """[(kind, microbatch), ...]: what `stage` runs under 1F1B, in the simulator's order."""
    events = pipeline.simulate("1f1b", stages, microbatches).events
    return [(e.kind, e.microbatch) for e in sorted(events, key=lambda e: e.start)
            if e.stage == stage]


def pp_stage_activation_bytes(schedule, stages, microbatches, num_layers,
                              layer_bytes) -> list[float]:
    """Per stage: its layers (labkit.memory's split) x `layer_bytes` x the micro-batches the
    simulator finds it holding at its peak."""
    held = pipeline.simulate(schedule, stages, microbatches).peak_in_flight
    return [n * layer_bytes * k for n, k in zip(memory._stage_layers(num_layers, stages), held)]


def pp_gpt3_stage0_gb(schedule, stages=8, microbatches=64) -> float:
    """GB of activations stage 0 holds for GPT-3 175B (96 layers, one 2,048-token sequence per
    micro-batch, Korthikanti et al.'s bytes per layer, no tensor parallelism)."""
    layer = activation_bytes(2048, 1, 12288, 96)
    return pp_stage_activation_bytes(schedule, stages, microbatches, 96, layer)[0] / 1e9


# ----------------------------------------------------------------------- 08 3D parallelism

def mesh_groups(shape, names) -> dict[str, list[list[int]]]:
    """{axis: its process groups}, as init_device_mesh("cuda", shape, mesh_dim_names=names)
    numbers the ranks (row-major: the last axis innermost): each group ascending, the groups
    sorted by their first rank."""
    import torch

    ranks = torch.arange(math.prod(shape)).reshape(tuple(shape))
    return {name: sorted(ranks.movedim(i, -1).reshape(-1, shape[i]).tolist())
            for i, name in enumerate(names)}


def layout_problem(model, tp, pp, dp, cp=1, micro_batch=1, gpu="h100-sxm", gpus_per_node=8,
                   global_batch=512, seq_len=4096) -> str | None:
    """Why the layout cannot train `model` ("<kind>: <why>", the kinds in the planner's order:
    tp across nodes, divisibility, batch, memory), or None when it fits: FSDP over dp x cp,
    full recomputation, 1F1B with global_batch / (dp x micro_batch) micro-batches."""
    spec = models.get_model(model)
    lay = planner.Layout(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=micro_batch)
    problem = planner.degree_problem(spec, lay, gpus_per_node, seq_len)
    if problem:
        return problem
    if global_batch % (dp * micro_batch):
        return (f"batch: global_batch={global_batch} is not divisible by dp x micro_batch = "
                f"{dp} x {micro_batch}")
    need = memory.estimate_memory(spec, batch_size=micro_batch, seq_len=seq_len, zero_stage=3,
                                  dp=dp * cp, tp=tp, pp=pp, cp=cp, recompute="full",
                                  microbatches=global_batch // (dp * micro_batch)).total
    have = hardware.get_gpu(gpu).memory
    return None if need <= have else f"memory: needs {need / 1e9:.1f} GB of {have / 1e9:.0f}"


def problem_kind(reason) -> str | None:
    """"memory" for "memory: needs ...": the kind a layout_problem reason starts with."""
    return None if reason is None else str(reason).split(":", 1)[0].strip()


def by_kind(fn):
    """`fn` (a layout_problem: the learner's or the reference) returning only the kind of its
    reason, which the check compares (the words after it are free)."""
    @functools.wraps(fn)
    def kind(*args, **kwargs):
        return problem_kind(fn(*args, **kwargs))
    return kind


def utilisation(model, tokens_per_second, gpus, gpu, seq_len,
                recompute="none") -> tuple[float, float]:
    """(MFU, HFU) of a run: model FLOPs per token (6N + 12 L a d s), and with the recomputed
    forward counted, x tokens/s / (gpus x the GPU's dense bf16 peak)."""
    kw = dict(num_gpus=gpus, seq_len=seq_len)
    return (flops.mfu(model, tokens_per_second, gpu, **kw),
            flops.hfu(model, tokens_per_second, gpu, recompute=recompute, **kw))


def step_seconds(model, global_batch, seq_len, gpus, gpu, mfu) -> float:
    """Seconds of one step of `global_batch` sequences at utilisation `mfu` of the bf16 peak."""
    work = flops.flops_per_step(model, global_batch, seq_len)
    return work / (gpus * hardware.get_gpu(gpu).flops("bf16") * mfu)


def gpus_needed(tp, pp, dp, cp=1) -> int:
    return planner.Layout(tp=tp, pp=pp, dp=dp, cp=cp).gpus


def dp_for(gpus, tp, pp, cp=1) -> int:
    """The data-parallel degree that fills `gpus`; ValueError when tp x pp x cp does not divide
    it."""
    inner = planner.Layout(tp=tp, pp=pp, cp=cp).gpus
    if gpus % inner:
        raise ValueError(f"gpus={gpus} is not a multiple of tp x pp x cp = {inner}")
    return gpus // inner
