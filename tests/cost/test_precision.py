"""Gradient precision, ZeRO placement and offload, FP8: labkit's options against the figures
Megatron-LM, the Ultra-Scale Playbook, DeepSpeed and the FP8 formats give."""
from __future__ import annotations

import pytest

from labkit.hardware import LINKS
from labkit.memory import PRECISIONS, bytes_per_param, estimate_memory, state_bytes
from labkit.placement import model_states, offload_traffic
from labkit.precision import FORMATS, gradient_bytes

P = 7_000_000_000


# -- fp32 gradients -----------------------------------------------------------------------------

def test_megatron_distributed_optimizer_table():
    # Megatron-LM docs, "Distributed Optimizer": bytes per parameter, d = data-parallel size.
    # Each row written out term by term: (model param, grad, fp32 main grad copy, fp32 main
    # param, Adam moments); the distributed optimizer shards what belongs to the step.
    d = 8
    rows = {  # labkit options: (replicated terms, sharded terms) of Megatron's count
        ("fp16-mixed", "both"): (2 + 2, 4 + 4 + 8),     # 20 | 4 + 16/d
        ("bf16-mixed", "fp32"): (2 + 4, 4 + 8),         # 18 | 6 + 12/d (main_grad not sharded)
        ("fp32", "param"): (4 + 4, 8),                  # 16 | 8 + 8/d
    }
    for (precision, grad_accum), (kept, sharded) in rows.items():
        assert bytes_per_param(precision, "adam", grad_accum) == kept + sharded
        est = estimate_memory(P, precision=precision, optimizer="adam", grad_accum=grad_accum,
                              zero_stage=1, dp=d)
        assert est.model_states == pytest.approx((kept + sharded / d) * P)


def test_playbook_20_bytes_and_zero_default_16():
    # Ultra-Scale Playbook: bf16 params 2 + bf16 grads 2 + fp32 params 4 + fp32 grads 4 +
    # Adam 4 + 4; ZeRO (Rajbhandari et al. 2020, §3.1): 2 + 2 + K with K = 12.
    assert bytes_per_param("bf16-mixed", "adamw", "both") == 2 + 2 + 4 + 4 + (4 + 4)
    assert bytes_per_param("bf16-mixed", "adamw") == 2 + 2 + 12
    assert state_bytes("bf16-mixed", "adamw", "fp32") == (2, 4, 12)
    assert gradient_bytes(2, "both") == (2, 4)


# -- DeepSpeed's estimators, written out from deepspeed/runtime/zero/{stage_1_and_2,stage3}.py --

def ds_zero2(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
             additional_buffer_factor=1.5):
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optim"
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
             cpu_offload=True, cpu_offload_params=True, zero_init=True,
             additional_buffer_factor=1.5):
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


CASES = [(1_300_000_000, 8, 1, 50_000_000), (6_738_415_616, 8, 2, 131_072_000),
         (70_553_706_496, 8, 16, 1_050_673_152)]


@pytest.mark.parametrize("params, per_node, nodes, largest", CASES)
def test_deepspeed_zero2_estimator(params, per_node, nodes, largest):
    n = per_node * nodes
    # 2P + 18P/N: the 16-bit gradients and an fp32 copy, both partitioned (grad_accum="both")
    est = estimate_memory(params, zero_stage=2, dp=n, grad_accum="both")
    assert est.model_states == pytest.approx(ds_zero2(params, per_node, nodes, False)[1], abs=1)
    # offload_optimizer: the GPU keeps the 16-bit weights only
    off = estimate_memory(params, zero_stage=2, dp=n, grad_accum="both", offload="optimizer")
    assert off.model_states == pytest.approx(ds_zero2(params, per_node, nodes, True)[1], abs=1)


@pytest.mark.parametrize("params, per_node, nodes, largest", CASES)
def test_deepspeed_zero3_estimator(params, per_node, nodes, largest):
    # 4 L + 18P/N: 2 + 4 + 12 per partitioned parameter (an fp32 gradient partition,
    # grad_accum="fp32"), and the gathered largest layer's 16-bit weights and gradient.
    n = per_node * nodes
    kw = dict(zero_stage=3, dp=n, grad_accum="fp32", largest_layer=largest)
    for offload, ds_opts in (("none", (False, False)), ("optimizer", (True, False)),
                             ("params", (True, True))):
        cpu, gpu, _ = ds_zero3(params, largest, per_node, nodes, *ds_opts)
        est = estimate_memory(params, offload=offload, **kw)
        assert est.model_states == pytest.approx(gpu, abs=1), offload
        if offload != "none":      # DeepSpeed's host figure: per node, with a 1.5x buffer factor
            assert est.host_bytes * per_node * 1.5 == pytest.approx(cpu, rel=1e-12), offload
    assert estimate_memory(params, zero_stage=3, dp=n).model_states == pytest.approx(
        16 * params / n)


# -- offload -------------------------------------------------------------------------------------

def test_offload_splits_gpu_and_host():
    base = estimate_memory("llama2-7b", seq_len=1024, zero_stage=2, dp=8)
    off = estimate_memory("llama2-7b", seq_len=1024, zero_stage=2, dp=8, offload="optimizer")
    assert off.params == base.params and off.activations == base.activations
    assert off.grads == 0 and off.optimizer_states == 0
    assert off.host == {"params": 0.0, "grads": base.grads,
                        "optimizer_states": base.optimizer_states}
    assert off.total + off.host_bytes == pytest.approx(base.total)
    assert "host memory" in off.explain["optimizer_states"]
    # ZeRO-1 accumulates the whole gradient on the GPU; its shard goes to the host for the step
    z1 = estimate_memory(P, zero_stage=1, dp=8, offload="optimizer")
    assert z1.grads == 2 * P and z1.host["grads"] == 2 * P / 8
    assert estimate_memory(P, zero_stage=1, dp=8).host_bytes == 0


def test_offload_traffic_over_pcie():
    n, dp = P, 8
    shard = n / dp
    t = offload_traffic(n, offload="optimizer", zero_stage=2, dp=dp, microbatches=4, link="pcie4")
    assert (t.device_to_host, t.host_to_device) == (4 * 2 * shard, 2 * shard)
    assert t.time == pytest.approx(4 * 2 * shard / LINKS["pcie4"].bandwidth)
    t5 = offload_traffic(n, offload="optimizer", zero_stage=2, dp=dp, microbatches=4)
    assert t.time / t5.time == pytest.approx(2.0)             # PCIe 5 doubles the lane rate
    z1 = offload_traffic(n, offload="optimizer", zero_stage=1, dp=dp, microbatches=4,
                         grad_accum="fp32")
    assert z1.device_to_host == 4 * shard                     # once per step, fp32
    p = offload_traffic("llama2-7b", offload="params", zero_stage=3, dp=dp, microbatches=2)
    assert p.host_to_device == 2 * p.device_to_host           # 4 gathers of 2 B, 2 grads of 2 B
    assert "llama2-7b" not in p.explain and "parameters per shard" in p.explain


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload="optimizer"), "offload='optimizer' needs zero_stage >= 1"),
    (dict(offload="params", zero_stage=2), "offload='params' needs zero_stage=3"),
    (dict(offload="disk", zero_stage=3), "offload='disk' is not supported; allowed"),
    (dict(largest_layer=1e6, zero_stage=2), "largest_layer=1000000.0 counts the unit ZeRO-3"),
    (dict(largest_layer=-1, zero_stage=3), "largest_layer=-1 must be a number > 0"),
    (dict(grad_accum="fp64"), "grad_accum='fp64' is not supported; allowed: 'param', 'fp32'"),
    (dict(grad_accum="both", precision="fp32"), "grad_accum='both' adds an fp32 copy"),
])
def test_bad_placement_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(P, **kwargs)


def test_offload_traffic_bad_input():
    with pytest.raises(ValueError, match="offload='none' moves nothing"):
        offload_traffic(P, offload="none")
    with pytest.raises(ValueError, match="link='pcie9' is not supported"):
        offload_traffic(P, link="pcie9")


def test_model_states_without_options_is_zero():
    gpu, host = model_states(1000, 2, (2, 0), 12, zero_stage=3, dp=4)
    assert gpu == {"params": 500.0, "grads": 500.0, "optimizer_states": 3000.0}
    assert sum(host.values()) == 0


# -- FP8 ----------------------------------------------------------------------------------------

def test_fp8_mixed_keeps_bf16_model_states():
    assert "fp8-mixed" not in PRECISIONS          # the CPU labs and exercises iterate over these
    assert state_bytes("fp8-mixed") == state_bytes("bf16-mixed")
    a = estimate_memory("llama2-7b", seq_len=1024, precision="fp8-mixed")
    b = estimate_memory("llama2-7b", seq_len=1024, precision="bf16-mixed")
    assert a.model_states == b.model_states and a.activations == b.activations


@pytest.mark.parametrize("name, dtype", [("fp32", "float32"), ("bf16", "bfloat16"),
                                         ("fp16", "float16"), ("fp8-e4m3", "float8_e4m3fn"),
                                         ("fp8-e5m2", "float8_e5m2")])
def test_formats_match_torch_finfo(name, dtype):
    torch = pytest.importorskip("torch")
    info, fmt = torch.finfo(getattr(torch, dtype)), FORMATS[name]
    assert fmt.max == info.max and fmt.min_normal == info.smallest_normal
    assert fmt.epsilon == info.eps and fmt.bits == info.bits


def test_fp8_ranges_and_rounding_error():
    e4m3, e5m2 = FORMATS["fp8-e4m3"], FORMATS["fp8-e5m2"]
    assert (e4m3.max, e5m2.max) == (448.0, 57344.0)
    assert (e4m3.max_relative_error, e5m2.max_relative_error) == (2.0**-4, 2.0**-3)
    assert (e4m3.min_subnormal, e5m2.min_subnormal) == (2.0**-9, 2.0**-16)


@pytest.mark.parametrize("name, dtype", [("fp8-e4m3", "float8_e4m3fn"),
                                         ("fp8-e5m2", "float8_e5m2")])
def test_fp8_rounding_error_measured(name, dtype):
    # Round a dense grid of normal-range values through torch's FP8 casts: the error relative
    # to the value stays below 2^-(m+1) (its supremum is u / (1 + u), at a midpoint just above
    # a power of two), and relative to the rounded result it reaches 2^-(m+1) exactly.
    torch = pytest.importorskip("torch")
    fmt = FORMATS[name]
    x = torch.logspace(torch.log2(torch.tensor(fmt.min_normal)).item(),
                       torch.log2(torch.tensor(fmt.max / 2)).item(), 200_001, base=2,
                       dtype=torch.float64)
    u = fmt.max_relative_error
    midpoints = 2.0 ** torch.arange(-6, 8, dtype=torch.float64) * (1 + u)
    x = torch.cat([x, midpoints])
    y = x.to(getattr(torch, dtype)).to(torch.float64)
    assert ((y - x).abs() / x).max().item() <= u
    assert ((y - x).abs() / y).max().item() == u


def test_table_shows_host_bytes():
    off = estimate_memory(P, zero_stage=3, dp=8, offload="params")
    row = [line for line in off.table().splitlines() if line.startswith("host (offload)")]
    assert len(row) == 1 and f"{off.host_bytes / 1e9:.2f}" in row[0] and "not in total" in row[0]
    assert "host" not in estimate_memory(P, zero_stage=3, dp=8).table()
