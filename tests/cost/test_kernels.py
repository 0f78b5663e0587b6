"""labkit.kernels: a layer's kernels on one GPU, and the host's time to launch them."""
from __future__ import annotations

import pytest

from labkit import kernels
from labkit.hardware import get_gpu
from labkit.kernels import (FRAMEWORKS, attention_ramp, gemm_seconds, head_seconds, layer_seconds,
                            optimizer_seconds)

H100 = get_gpu("h100-sxm")


def per_flop(m, n, k, gpu="h100-sxm"):
    return gemm_seconds(m, n, k, gpu) / (2 * m * n * k)


def test_a_large_matmul_runs_at_the_measured_ceiling():
    t = gemm_seconds(8192, 8192, 8192, "h100-sxm")
    share = kernels.FACTS[H100.name].gemm * kernels.SUSTAINED
    assert kernels.matmul_efficiency("h100-sxm") == share
    ideal = 2 * 8192**3 / (H100.flops("bf16") * share)
    assert t == pytest.approx(ideal, rel=0.01)
    assert 0.75 < kernels.FACTS[H100.name].gemm < 0.9      # measured, below the datasheet
    assert 0.5 < kernels.SUSTAINED < 1


def test_small_matmuls_cost_more_per_flop_and_skinny_ones_are_memory_bound():
    assert per_flop(1024, 1024, 1024) > 1.5 * per_flop(8192, 8192, 8192)
    assert per_flop(4096, 4096, 4096) < per_flop(2048, 2048, 2048) < per_flop(1024, 1024, 1024)
    # a matrix-vector product: its bytes at HBM bandwidth, not its FLOPs
    t = gemm_seconds(1, 8192, 8192, "h100-sxm")
    assert t == pytest.approx(2 * 8192 * 8192 / H100.memory_bandwidth + kernels.KERNEL_LATENCY,
                              rel=0.01)


def test_flash_attention_ramps_up_with_the_block_length():
    assert attention_ramp(16384) == pytest.approx(1.0)
    assert attention_ramp(512) < attention_ramp(1024) < attention_ramp(4096) < 1.0
    assert attention_ramp(1024) == pytest.approx(0.69 / 0.973, rel=0.03)   # FA2's Fig. 4


def layer(**kw):
    base = dict(tokens=4096, seq_len=4096, tp=1)
    return layer_seconds("llama3-8b", "h100-sxm", **{**base, **kw})


def test_tensor_parallelism_splits_the_matmuls_and_sequence_parallelism_the_rest():
    one, four = layer(), layer(tp=4)
    assert four.matmul == pytest.approx(one.matmul / 4, rel=0.1)
    assert four.matmul > one.matmul / 4                   # smaller shards, less efficient
    assert layer(tp=4, sequence_parallel=True).elementwise < four.elementwise
    assert four.attention == pytest.approx(one.attention / 4, rel=0.05)


def test_recompute_adds_the_forward_again():
    none, full, sel = layer(), layer(recompute="full"), layer(recompute="selective")
    assert full.matmul == pytest.approx(none.matmul * 4 / 3, rel=0.01)
    assert full.elementwise == pytest.approx(none.elementwise * 4 / 3, rel=0.01)
    assert sel.matmul == none.matmul and none.attention < sel.attention < full.attention * 1.01


def test_eager_kernels_move_more_bytes_and_take_longer_on_the_host():
    fused, eager = layer(framework="megatron"), layer(framework="nanotron")
    assert eager.elementwise > 2 * fused.elementwise
    assert eager.host > 5 * fused.host and eager.matmul == fused.matmul


def test_eager_attention_is_slower_than_flash_at_long_sequences():
    flash = layer_seconds("gpt3-175b", "a100-80gb", tokens=2048, seq_len=2048, tp=8)
    eager = layer_seconds("gpt3-175b", "a100-80gb", tokens=2048, seq_len=2048, tp=8,
                          attention="eager")
    assert eager.attention > flash.attention


def test_context_parallel_blocks_are_shorter_so_slower_per_flop():
    whole = layer(tokens=8192, seq_len=8192)
    split = layer(tokens=1024, seq_len=8192, cp=8)
    assert split.attention > whole.attention / 8 * 1.2


def test_the_head_and_the_optimizer():
    h = head_seconds("llama3-8b", "h100-sxm", tokens=4096)
    flops = 6 * 4096 * 4096 * 128256
    assert h.matmul == pytest.approx(flops / (H100.flops("bf16")
                                              * kernels.matmul_efficiency(H100)), rel=0.05)
    assert head_seconds("llama3-8b", "h100-sxm", tokens=4096, framework="nanotron").elementwise \
        > h.elementwise
    assert optimizer_seconds(1e9, "h100-sxm") == pytest.approx(32e9 / H100.memory_bandwidth)


def test_every_framework_and_device_figure_says_where_it_comes_from():
    for fw in FRAMEWORKS.values():
        assert fw.source and fw.kernels in kernels.ELEMENTWISE and fw.host_per_layer > 0
    for facts in kernels.FACTS.values():
        assert facts.source and 0 < facts.attention < facts.gemm < 1
    with pytest.raises(ValueError, match="framework"):
        layer(framework="jax")


def test_a_small_micro_batch_is_host_bound_in_an_eager_framework():
    """The sweep's 1B at tp 8: micro-batch 1 is bound by the host, micro-batch 16 is not."""
    from labkit import field
    from labkit.planner import Layout, evaluate

    def priced(b):
        lay = Layout(tp=8, dp=1, micro_batch=b, sequence_parallel=True)
        return evaluate(field.SWEEP_MODELS["1B"], lay, global_batch=256, **field.SWEEP_SETUP)

    assert priced(1).breakdown["host"] > priced(1).breakdown["compute"]
    assert priced(16).breakdown["host"] == 0
    assert priced(16).tokens_per_second > 3 * priced(1).tokens_per_second     # measured: 4.1x
