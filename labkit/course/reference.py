"""Reference answers that the check cells of solutions/ compare with, computed at run time.

They are the answers, so the check cells call them by name and never spell them out, and an
exercise that calls one is refused by the grader (labkit.course.forbid forbids this module to
every exercise). Each follows the exercise of the same name in its module's solutions notebook.
"""
from __future__ import annotations

# ----------------------------------------------------------------------- 01 memory math

LLAMA_CASES = ("llama2-7b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", "debug")


def model_state_bytes(precision: str, optimizer: str) -> int:
    from labkit.memory import bytes_per_param

    return bytes_per_param(precision, optimizer)


def llama_configs(names=LLAMA_CASES) -> list:
    """transformers LlamaConfigs of labkit presets, each printing as its model's name."""
    import transformers

    from labkit.models import get_model

    class NamedConfig(transformers.LlamaConfig):
        def __repr__(self):
            return f"<LlamaConfig of {self.name_or_path}>"

    return [NamedConfig.from_dict(get_model(n).to_hf_config().to_dict(), name_or_path=n)
            for n in names]


def llama_layer_params(config) -> int:
    """transformers' own LlamaDecoderLayer for `config`, built on the meta device and counted."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, layer_idx=0)
    return sum(p.numel() for p in layer.parameters())


def activation_bytes(seq_len, batch_size, hidden_size, num_heads, recompute="none") -> float:
    from labkit.memory import activation_bytes_per_layer

    return activation_bytes_per_layer(seq_len=seq_len, batch_size=batch_size,
                                      hidden_size=hidden_size, num_heads=num_heads,
                                      recompute=recompute)


def min_gpus_zero3(model: str, gpu: str, seq_len: int, recompute: str = "full") -> int:
    """dp = 1, 2, 3, ... until labkit's estimate fits; ValueError when none up to 1e5 does and
    the activations alone exceed the GPU."""
    from labkit.hardware import GPUS
    from labkit.memory import estimate_memory

    def estimate(dp):
        return estimate_memory(model, batch_size=1, seq_len=seq_len, zero_stage=3, dp=dp,
                               recompute=recompute)

    if estimate(1).activations >= GPUS[gpu].memory:
        raise ValueError(f"{model} at {seq_len} tokens: the activations alone exceed {gpu}")
    for dp in range(1, 100_000):
        if estimate(dp).fits(gpu):
            return dp
    raise ValueError(f"{model} does not fit on {gpu} at any dp")


def activations_alone(model: str, seq_len: int, recompute: str) -> float:
    from labkit.memory import estimate_memory

    return estimate_memory(model, seq_len=seq_len, recompute=recompute).activations


# ----------------------------------------------------------------------- 02 collectives

def ring_all_reduce_time(nbytes, world_size, bandwidth, latency) -> float:
    from labkit.comm import collective_time

    return collective_time("all_reduce", nbytes, world_size, bandwidth, latency)


def ddp_all_reduce_time() -> float:
    """Seconds of DDP's all-reduce of 7B bf16 gradients on 8 GPUs over NVLink 4."""
    from labkit.hardware import LINKS

    nv = LINKS["nvlink4"]
    return ring_all_reduce_time(2 * 7e9, 8, nv.bandwidth, nv.latency)


def busbw(op, nbytes, seconds, world_size) -> float:
    from labkit.comm import bus_bandwidth

    return bus_bandwidth(op, nbytes, seconds, world_size)


NCCL_LINE = "   268435456       8388608     float    none      -1    652.5       ?       ?"


def read_busbw(line: str = NCCL_LINE) -> tuple[float, float]:
    """(busbw in GB/s, share of NVLink 4 per direction) of an all_gather_perf line on 8 GPUs."""
    from labkit.hardware import LINKS

    fields = line.split()
    value = busbw("all_gather", int(fields[0]), float(fields[5]) * 1e-6, 8)
    return value / 1e9, value / LINKS["nvlink4"].bandwidth
