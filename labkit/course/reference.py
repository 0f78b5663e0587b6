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

from labkit import comm, hardware, memory, models, scaling

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
    hi = 1
    while not fits(hi):
        hi *= 2
    lo = hi // 2                  # does not fit (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi
