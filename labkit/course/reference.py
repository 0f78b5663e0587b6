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

from labkit import (comm, design, flops, hardware, memory, models, pipeline, planner,
                    resilience, scaling)
from labkit.course import reference_trace

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
    def kind(*args, **kwargs):
        return problem_kind(fn(*args, **kwargs))
    # its name and doc, not functools.wraps: `__wrapped__` would hand out `fn` (a guarded
    # reference's original, labkit.course.forbid)
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(fn, attr):
            setattr(kind, attr, getattr(fn, attr))
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


# ----------------------------------------------------------------------- 09 interview prep

def states_gb(num_params, zero_stage, dp) -> float:
    """GB (1e9 bytes) of model states per GPU: bf16-mixed AdamW, ZeRO-`zero_stage` over dp."""
    return memory.estimate_memory(num_params, zero_stage=zero_stage, dp=dp).total / 1e9


def bubble_share(stages, microbatches) -> float:
    """The idle share of a 1F1B (or GPipe) step: (p - 1)/(m + p - 1)."""
    return pipeline.bubble_formula("1f1b", stages, microbatches)[0]


def all_reduce_seconds(nbytes, world_size, link) -> float:
    """A ring all-reduce of `nbytes` on `world_size` GPUs over LINKS[link], per direction,
    latency included."""
    the_link = hardware.get_link(link)
    return comm.collective_time("all_reduce", nbytes, world_size, the_link.bandwidth,
                                the_link.latency)


def reported_mfu(model, tokens_per_second, gpus, gpu, seq_len) -> float:
    return flops.mfu(model, tokens_per_second, gpu, num_gpus=gpus, seq_len=seq_len)


def trainable_tokens(model, gpus, gpu, days, mfu, seq_len) -> float:
    return design.trainable_tokens(model, gpus, gpu, days, mfu, seq_len)


def gpus_for_tokens(model, tokens, gpu, days, mfu, seq_len) -> int:
    return design.gpus_for_tokens(model, tokens, gpu, days, mfu, seq_len)


def checkpoint_minutes(model, gpus, daily_failure_rate, ckpt_bandwidth) -> float:
    """Young's interval, in minutes, for a 12 B/param checkpoint written at ckpt_bandwidth."""
    write = resilience.write_seconds(resilience.checkpoint_bytes(model), ckpt_bandwidth)
    return resilience.young_daly_interval(resilience.job_mtbf(gpus, daily_failure_rate),
                                          write) / 60


def _no_attention(model, seq_len):
    """FLOPs per token without the attention term: 6N only (the usual shortcut)."""
    return flops.flops_per_token(model, seq_len) - 3 * flops.attention_flops_per_token(model,
                                                                                        seq_len)


def _relative_min_microbatches(stages, target, chunks=1) -> int:
    """The fewest micro-batches whose bubble *relative to the ideal time* meets `target` (the
    mix-up of 07's min_microbatches: the target is the idle share of the step)."""
    schedule = "interleaved-1f1b" if chunks > 1 else "1f1b"
    return pipeline.min_microbatches(stages, target, schedule, v=chunks, relative=True)


# ----------------------------------------------------------------------- 10 mixture of experts

ROUTING = ("probs", "indices", "weights", "tokens_per_expert", "aux_loss")


def top_k_route(x, gate_weight, k) -> dict:
    """labkit's TopKRouter (softmax over the experts, the k most probable kept, their weights
    rescaled to sum to 1; the Switch / GShard auxiliary loss) with `gate_weight` (E, h) as its
    gate, on x (T, h), in gate_weight's dtype: {"probs" (T, E), "indices" (T, k), "weights"
    (T, k), "tokens_per_expert" (E,), "aux_loss": a float}."""
    import torch

    from labkit.parallel.expert import TopKRouter

    num_experts, hidden = gate_weight.shape
    router = TopKRouter(hidden, num_experts, k).to(gate_weight.dtype)
    with torch.no_grad():
        router.gate.weight.copy_(gate_weight)
        r = router(x.to(gate_weight.dtype))
    return {"probs": r.probs, "indices": r.indices, "weights": r.weights,
            "tokens_per_expert": r.tokens_per_expert, "aux_loss": float(r.aux_loss)}


def _shape_of(value):
    """What the structure check compares of one part: a tensor's shape, "a number" for a number
    or a one-element tensor, else the type's name."""
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, (int, float)):
        return "a number"
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "numel"):
        return "a number" if len(shape) == 0 else tuple(int(n) for n in shape)
    return f"a {type(value).__name__}"


def routing_shapes(fn):
    """`fn` (a top_k_route: the learner's or the reference) returning only what its result holds:
    {part: its shape, or "a number"} for a dict, else what it is; the first check compares that
    (the parts' values come next, each with its own check)."""
    def shapes(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not isinstance(out, dict):
            return f"a {type(out).__name__}, not a dict of {', '.join(ROUTING)}"
        return {str(key): _shape_of(value) for key, value in out.items()}
    _named_as(shapes, fn)
    return shapes


def _named_as(wrapper, fn) -> None:
    """`fn`'s name and doc on `wrapper` (not functools.wraps: `__wrapped__` would hand out `fn`,
    a guarded reference's original: labkit.course.forbid)."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(fn, attr):
            setattr(wrapper, attr, getattr(fn, attr))


def permute_to_expert_major(tokens_per_expert_group, ep_size) -> tuple:
    """labkit.parallel.expert.permute_to_expert_major: (indices, tokens_per_expert)."""
    from labkit.parallel import expert

    return expert.permute_to_expert_major(tokens_per_expert_group, ep_size)


def _as_list(value):
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_as_list(v) for v in value]
    return value


def as_lists(fn):
    """`fn` (a permute_to_expert_major: the learner's or the reference) returning its two parts
    as lists of numbers (tensors or lists alike), which the check compares."""
    def listed(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(_as_list(v) for v in out) if isinstance(out, (tuple, list)) else \
            _as_list(out)
    _named_as(listed, fn)
    return listed


def all_to_all_bytes(tokens, k, hidden, bytes_per_value, capacity_factor=None) -> float:
    """Bytes of one rank's all-to-all buffers in one MoE layer, forward and backward, for one
    micro-batch of `tokens` tokens: labkit.comm.step_communication("ep") of a one-layer model of
    width `hidden` routing each token to `k` experts, per layer and micro-batch (its count x the
    payload of each)."""
    spec = models.get_model("debug-moe").with_(
        num_layers=1, hidden_size=hidden, num_heads=1, num_kv_heads=1, experts_per_token=k,
        num_experts=2 * k, dense_layers=0)
    (a2a,) = comm.step_communication("ep", model=spec, ep=2, seq_len=tokens, batch_size=1,
                                     capacity_factor=capacity_factor,
                                     activation_bytes=bytes_per_value).collectives
    return a2a.count * a2a.nbytes


def ep_step_gb(model, ep, seq_len, batch_size=1, capacity_factor=None,
               activation_bytes=2) -> float:
    """GB (1e9 bytes) that leave one rank through the all-to-alls of one training step (one
    micro-batch): labkit.comm.step_communication("ep")'s bytes sent."""
    return comm.step_communication("ep", model=model, ep=ep, seq_len=seq_len,
                                   batch_size=batch_size, capacity_factor=capacity_factor,
                                   activation_bytes=activation_bytes).total_bytes / 1e9


# The usual wrong answers of each check, (what went wrong, the value it gives): a learner whose
# value matches one is told which (`check_with_mistakes`). A label names the mistake and the
# idea it missed, never the right formula or number (tests/course/test_grading_hints.py).
MISTAKES = {
    "states_gb": (
        ("GiB instead of GB: the answer is in GB (1e9 bytes), not GiB",
         lambda n, z, d: states_gb(n, z, d) * 1e9 / 2**30),
        ("every byte of model state divided by dp at every stage: each ZeRO stage shards only "
         "some of the states (which ones is what the stage number says)",
         lambda n, z, d: 16 * n / d / 1e9),
        ("only the optimizer states: the weights and the gradients are missing",
         lambda n, z, d: memory.estimate_memory(n, optimizer="adamw", zero_stage=z,
                                                dp=d).optimizer_states / 1e9)),
    "bubble": (
        ("(p-1)/m is the bubble relative to the ideal time; the idle share is of the whole "
         "step, whose length includes the bubble itself", lambda p, m: (p - 1) / m),
        ("(p-1)/(m+p): the step's length counts one slot too many", lambda p, m: (p - 1) / (m + p)),
        ("(p-1)/p: the bubble shrinks with more micro-batches; m is missing",
         lambda p, m: (p - 1) / p)),
    "min_microbatches": (
        ("the target met by the bubble relative to the ideal time, not by the idle share of "
         "the step: the target is the share of the whole step (bubble included) that a GPU "
         "waits", _relative_min_microbatches),),
    "all_reduce_seconds": (
        ("the bidirectional figure: both directions added; a ring sends each byte one way",
         lambda S, n, link: comm.collective_time("all_reduce", S, n, hardware.get_link(
             link).bidirectional, hardware.get_link(link).latency)),
        ("S / B: a ring all-reduce is a reduce-scatter and then an all-gather; each rank sends "
         "more than S",
         lambda S, n, link: S / hardware.get_link(link).bandwidth
         + 2 * (n - 1) * hardware.get_link(link).latency),
        ("one all-gather (or reduce-scatter) alone; an all-reduce is both",
         lambda S, n, link: comm.collective_time("all_gather", S, n, hardware.get_link(
             link).bandwidth, hardware.get_link(link).latency)),
        ("no latency: every step of the ring also pays the link's latency",
         lambda S, n, link: comm.collective_time("all_reduce", S, n,
                                                 hardware.get_link(link).bandwidth))),
    "reported_mfu": (
        ("the peak with sparsity: the datasheet's starred figure is not the dense peak "
         "training runs at", lambda *a: reported_mfu(*a) / 2),
        ("6N only: the attention FLOPs per token are missing",
         lambda model, tps, g, gpu, s: _no_attention(model, s) * tps
         / (g * hardware.get_gpu(gpu).flops("bf16")))),
    "trainable_tokens": (
        ("6N only: the attention FLOPs per token are missing",
         lambda model, g, gpu, days, u, s: days * 86_400 * g * hardware.get_gpu(gpu).flops(
             "bf16") * u / _no_attention(model, s)),
        ("the peak with sparsity, not the dense peak", lambda *a: 2 * trainable_tokens(*a)),
        ("hours taken for days", lambda *a: trainable_tokens(*a) / 24)),
    "all_to_all_bytes": (
        ("half of the exchanges: a combine follows each dispatch, and the backward sends the "
         "gradients of both back the same ways", lambda *a, **k: all_to_all_bytes(*a, **k) / 2),
        ("one all-to-all only: the forward has a dispatch and a combine, and the backward "
         "repeats both for their gradients", lambda *a, **k: all_to_all_bytes(*a, **k) / 4),
        ("the capacity factor left out: each expert's buffer is that many times its even share",
         lambda t, k, h, b, capacity_factor=None: all_to_all_bytes(t, k, h, b)),
        ("k left out: a token is sent once to each of its k experts",
         lambda t, k, h, b, capacity_factor=None: all_to_all_bytes(t, 1, h, b,
                                                                    capacity_factor))),
    "checkpoint_minutes": (
        ("seconds, not minutes", lambda *a: 60 * checkpoint_minutes(*a)),
        ("a factor missing inside Young's square root",
         lambda *a: checkpoint_minutes(*a) / math.sqrt(2)),
        ("one GPU's MTBF, not the job's: many GPUs fail more often than one",
         lambda model, g, r, bw: checkpoint_minutes(model, 1, r, bw)),
        ("a checkpoint counted with the training states it does not save (a 16-bit copy of "
         "the weights, the gradients)",
         lambda model, g, r, bw: checkpoint_minutes(model, g, r, bw * 12 / 16))),
}
MISTAKES.update(reference_trace.MISTAKES)       # module 11's (reading traces)
# module 11's reference answers, called by its check cells as reference.NAME (a handout's
# stand-in for this module stands in for them too; reference_trace.py is left out of it)
from labkit.course.reference_trace import (collective_seconds, exposed,  # noqa: E402,F401
                                           exposed_all_reduce_ms, hidden_share, more_hidden,
                                           overlapped, slow_rank, waited_s)


def _args(case):
    if isinstance(case, tuple) and len(case) == 2 and isinstance(case[1], dict):
        return case
    return (case if isinstance(case, tuple) else (case,)), {}


def mistake_label(results, mistakes, rtol=1e-6) -> str | None:
    """The first of `mistakes` ((label, function) pairs) whose value equals the learner's on
    the first case where the learner's differs from the reference's. `results`: (args, kwargs,
    learner's value, reference's value) per case, in order (an iterable: read as far as
    needed); None if none is a known mistake."""
    tol = max(rtol or 0.0, 1e-6)
    for args, kwargs, got, want in results:
        try:
            got = float(got)
        except Exception:  # noqa: BLE001 - the check has said what the learner's code did
            return None
        if math.isclose(got, want, rel_tol=tol):
            continue
        for label, wrong in mistakes:
            try:
                value = wrong(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a case a mistake cannot price is not that one
                continue
            if math.isclose(got, value, rel_tol=tol) and not math.isclose(value, want,
                                                                           rel_tol=tol):
                return label
        return None
    return None


def known_mistake(fn, cases, reference, mistakes, rtol=1e-6) -> str | None:
    """`mistake_label` of the learner's `fn` against `reference` on `cases`."""
    def results():
        for case in cases:
            args, kwargs = _args(case)
            try:
                got = fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - the check has said what the learner's code raised
                got = None
            yield args, kwargs, got, reference(*args, **kwargs)

    return mistake_label(results(), mistakes, rtol)


def check_with_mistakes(name, fn, cases, reference, *, rtol=1e-9, unit=None, hint=None):
    """`grading.check_callable`; when it fails and the learner's value is one of MISTAKES[name],
    the message names that mistake (in a grading kernel whose expected values are the
    grader's, `grading.JUDGED`, the grader names it: labkit.course.verdict)."""
    from labkit.course import grading

    cases = list(cases)
    if reference is grading.JUDGED:
        grading.check_callable(name, fn, cases, reference, rtol=rtol, unit=unit, hint=hint,
                               mistakes=name)
        return
    try:
        grading.check_callable(name, fn, cases, reference, rtol=rtol, unit=unit, hint=hint,
                               mistakes=name)
    except grading.GradingError as err:
        label = known_mistake(fn, cases, reference, MISTAKES.get(name, ()), rtol)
        if label is None:
            raise
        raise grading.GradingError(f"{err}\n  that is a known mistake: {label}", name=name,
                                   expected=err.expected, received=err.received,
                                   hint=hint) from err.__cause__


# Diagnosis: the learner's function reads a case's evidence; the cases are built in the check
# (real labs, a fresh measurement), at seeds whose faults differ (tests/labs/test_interview_exercise.py
# checks that the straggler's slow rank is 0 at one seed and 1 at the other).
DIAGNOSIS_SEEDS = (1, 3)
# What to look at when a diagnosis is wrong: where the evidence shows it, never the answer (the
# case's own explanation of its right option, the former hint, gave it away).
DIAGNOSIS_HINTS = {
    "name": "which kinds of evidence the case holds (its keys: a log, an error, step times, a "
            "timeline, a pipeline, memory), and what each fault leaves in them",
    "slow_rank": "the timeline's events: which rank's steps hold work the other ranks' do not",
}


@functools.lru_cache(maxsize=None)
def diagnosis_case(name: str, seed: int):
    """labkit.labs.diagnose.build(name, seed), built once per grading kernel."""
    from labkit.labs import diagnose

    return diagnose.build(name, seed)


def check_diagnosis(name, fn, cases, truth, seeds=DIAGNOSIS_SEEDS[:1]):
    """fn(case.evidence) == the truth for each case name in `cases` at each of `seeds`: truth
    "name" (the case's name) or a key of case.numbers (e.g. "slow_rank"). A stub fails before any
    lab runs."""
    from labkit.course import grading

    try:
        fn({})
    except NotImplementedError as exc:
        raise grading.GradingError(f"{name}: {grading.NOT_ATTEMPTED}: {name}(evidence) still "
                                   f"raises NotImplementedError({exc})", name=name) from exc
    except Exception:  # noqa: BLE001 - an empty evidence dict is not a real case
        pass
    for seed in seeds:
        for case_name in ([cases] if isinstance(cases, str) else cases):
            case = diagnosis_case(case_name, seed)
            want = case.name if truth == "name" else case.numbers[truth]
            try:
                got = fn(case.evidence)
            except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
                raise grading.GradingError(
                    f"{name}: on the evidence of case {case_name!r} (seed {seed}) "
                    f"{name}(evidence) raised {type(exc).__name__}: {exc}", name=name) from exc
            grading.check_equal(f"{name} on {case_name!r} (seed {seed})", got, want,
                                hint=DIAGNOSIS_HINTS.get(truth, DIAGNOSIS_HINTS["name"]))
