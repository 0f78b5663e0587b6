"""labkit.flops: 6N + attention (PaLM App. B), Megatron's closed form, MFU vs HFU."""
from __future__ import annotations

import pytest

from labkit.flops import (attention_flops_per_token, flops_per_step, flops_per_token, hfu,
                          megatron_flops_per_step, mfu)
from labkit.models import ModelSpec, get_model


def test_llama2_7b_per_token_by_hand():
    spec = get_model("llama2-7b")
    n = 6_738_415_616 - 32000 * 4096             # the embedding lookup is not a matmul
    attn = 12 * 32 * 4096 * 4096                 # 12 L h s (PaLM, Appendix B)
    assert flops_per_token(spec, 4096) == 6 * n + attn
    assert flops_per_token(spec, 4096, causal=True) == 6 * n + attn / 2
    assert attention_flops_per_token(spec, 4096) * 3 == attn


def test_tied_head_is_counted_once_as_a_matmul():
    spec = get_model("gpt2")
    n = spec.num_params() - spec.embedding_params() + 50257 * 768
    assert flops_per_token(spec, 1024) == 6 * n + 12 * 12 * 768 * 1024


def test_plain_count_is_6n():
    assert flops_per_token(7e9) == 42e9


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_agrees_with_narayanan_2021_eq3(recompute):
    # A GPT layer without biases or norms is exactly Megatron's; norms add ~1e-4.
    spec = ModelSpec(name="gpt", arch="llama", num_layers=24, hidden_size=2048, num_heads=16,
                     num_kv_heads=16, ffn_size=8192, vocab_size=51200, max_seq_len=2048,
                     gated_mlp=False)
    ours = flops_per_step(spec, 8, 2048, recompute=recompute, hardware=True)
    assert ours == pytest.approx(megatron_flops_per_step(8, 2048, 24, 2048, 51200, recompute),
                                 rel=2e-4)


def test_mfu_and_hfu():
    spec = get_model("llama2-7b")
    tps = 8 * 3000.0
    per_token = flops_per_token(spec, 4096)
    assert mfu(spec, tps, "h100-sxm", num_gpus=8, seq_len=4096) == pytest.approx(
        per_token * tps / (8 * 989e12))
    # recomputation counts in HFU only
    assert hfu(spec, tps, "h100-sxm", 8, 4096) == mfu(spec, tps, "h100-sxm", 8, 4096)
    sel = hfu(spec, tps, "h100-sxm", 8, 4096, recompute="selective")
    full = hfu(spec, tps, "h100-sxm", 8, 4096, recompute="full")
    assert mfu(spec, tps, "h100-sxm", 8, 4096) < sel < full
    assert flops_per_token(spec, 4096, recompute="full") == per_token   # model FLOPs unchanged


def test_step_is_tokens_times_per_token():
    assert flops_per_step("gpt2", 16, 1024) == 16 * 1024 * flops_per_token("gpt2", 1024)


@pytest.mark.parametrize("call, match", [
    (lambda: mfu("gpt2", 0, "a100-80gb"), "tokens_per_second=0 must be a number > 0"),
    (lambda: mfu("gpt2", 1e5, "t4", dtype="bf16"), "dtype='bf16' is not supported"),
    (lambda: mfu("gpt2", 1e5, "z100"), "gpu='z100'"),
    (lambda: flops_per_token("gpt2", 1024, recompute="half"), "recompute='half'"),
    (lambda: flops_per_step("gpt2", 0, 1024), "batch_size=0"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_step_of_a_parameter_count_needs_seq_len():
    assert flops_per_step(7e9, 8, 1024) == 8 * 1024 * 42e9
    with pytest.raises(ValueError, match="seq_len=None.*pass seq_len"):
        flops_per_step(7e9, 8)
