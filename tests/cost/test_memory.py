"""labkit.memory against the ZeRO paper (Figure 1) and Korthikanti et al. 2022 (Table 2)."""
from __future__ import annotations

import pytest

from labkit.memory import (activation_bytes_per_layer, bytes_per_param, estimate_memory,
                           in_flight, stage_params, state_bytes)
from labkit.models import get_model


@pytest.mark.parametrize("stage, paper_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, paper_gb):
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam)."""
    m = estimate_memory(7.5e9, precision="fp16-mixed", optimizer="adam", zero_stage=stage, dp=64)
    assert round(m.model_states / 1e9, 1) == paper_gb
    assert m.activations == 0 and m.total == m.model_states


def test_zero_paper_exact_bytes():
    psi, nd, k = 7.5e9, 64, 12
    exact = [(2 + 2 + k) * psi, 2 * psi + 2 * psi + k * psi / nd, 2 * psi + (2 + k) * psi / nd,
             (2 + 2 + k) * psi / nd]
    got = [estimate_memory(psi, precision="fp16-mixed", optimizer="adam", zero_stage=s,
                           dp=nd).model_states for s in range(4)]
    assert got == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("precision, optimizer, expected", [
    ("bf16-mixed", "adamw", 16), ("fp16-mixed", "adam", 16), ("fp32", "adamw", 16),
    ("fp32", "sgd", 8), ("fp32", "sgd-momentum", 12), ("bf16", "adamw", 8), ("bf16", "sgd", 4),
    ("bf16-mixed", "adamw-8bit", 10), ("bf16-mixed", "sgd", 8),
])
def test_bytes_per_param(precision, optimizer, expected):
    assert bytes_per_param(precision, optimizer) == expected


def test_state_bytes_split_master_weights_into_optimizer_states():
    assert state_bytes("bf16-mixed", "adamw") == (2, 2, 12)
    assert state_bytes("bf16", "adamw") == (2, 2, 4)


def test_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8          # GPT-3 175B's shapes
    sbh = s * b * h
    f = activation_bytes_per_layer
    assert f(s, b, h, a) == sbh * (34 + 5 * a * s / h) == 114 * sbh
    assert f(s, b, h, a, tp=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert f(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t)))
    assert f(s, b, h, a, tp=t, recompute="selective") == sbh * (10 + 24 / t)
    assert f(s, b, h, a, tp=t, sequence_parallel=True, recompute="selective") == sbh * 34 / t
    assert f(s, b, h, a, recompute="full") == 2 * sbh
    assert f(s, b, h, a, tp=t, sequence_parallel=True, recompute="full") == 2 * sbh / t
    # sequence parallelism with tp=1 changes nothing
    assert f(s, b, h, a, sequence_parallel=True) == f(s, b, h, a)


def test_parts_add_up_and_explained():
    m = estimate_memory("llama2-7b", batch_size=2, seq_len=2048, zero_stage=2, dp=8, tp=2, pp=2,
                        microbatches=4)
    assert m.total == m.params + m.grads + m.optimizer_states + m.activations
    assert m.model_states == m.params + m.grads + m.optimizer_states
    assert set(m.breakdown()) <= set(m.explain)
    assert "ZeRO-2" in m.explain["grads"] and "ZeRO" not in m.explain["params"]
    assert max(m.per_stage) == m.total


def test_single_gpu_model_states_are_exact():
    spec = get_model("llama2-7b")
    m = estimate_memory(spec, seq_len=1024)
    n = spec.num_params()
    assert (m.params, m.grads, m.optimizer_states) == (2 * n, 2 * n, 12 * n)


def test_stage_params_cover_the_model():
    for name in ("llama2-7b", "debug"):
        spec = get_model(name)
        assert sum(stage_params(spec, 1, 4)) == spec.num_params()
    gpt2 = get_model("gpt2")           # tied: the last stage keeps a copy of the embedding
    assert sum(stage_params(gpt2, 1, 2)) == gpt2.num_params() + gpt2.vocab_size * 768
    assert stage_params(gpt2, 1, 1) == [gpt2.num_params()]


def test_pipeline_reports_the_worst_stage_and_in_flight():
    assert [in_flight(i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight(i, 4, 8, "gpipe") for i in range(4)] == [8] * 4
    assert in_flight(0, 4, 2) == 2
    kw = dict(batch_size=1, seq_len=4096, pp=4, microbatches=8, implementation="megatron")
    one = estimate_memory("llama2-7b", **kw)
    gpipe = estimate_memory("llama2-7b", schedule="gpipe", **kw)
    assert one.stage == 0 and gpipe.activations > one.activations
    # 1F1B's first stage: 8 layers x 4 in flight of one layer's activations, plus the mask
    per_layer = activation_bytes_per_layer(4096, 1, 4096, 32)
    assert one.activations == 8 * 4 * per_layer + 4096 * 4096 * 4


def test_cp_divides_the_sequence():
    a = estimate_memory("llama2-7b", seq_len=8192, cp=4, recompute="full")
    b = estimate_memory("llama2-7b", seq_len=2048, recompute="full")
    assert a.activations == b.activations


def test_fits():
    m = estimate_memory("debug", seq_len=128)
    assert m.fits("t4") and m.fits(1e9) and not m.fits(1000)
    assert not estimate_memory("llama2-70b", seq_len=4096).fits("h100-sxm")
    assert estimate_memory("llama2-70b", seq_len=4096, zero_stage=3, dp=64, tp=8,
                           sequence_parallel=True, recompute="full").fits("h100-sxm")
    with pytest.raises(ValueError, match="gpu='v100'"):
        m.fits("v100")


@pytest.mark.parametrize("kw, match", [
    (dict(tp=3), "tp=3 does not divide num_heads=32; allowed: 1, 2, 4, 8, 16, 32"),
    (dict(model="llama2-70b", tp=16), "tp=16 does not divide num_kv_heads=8"),
    (dict(pp=33), "pp=33 is larger than num_layers=32; allowed: 1 to 32"),
    (dict(dp=0), "dp=0 must be a whole number >= 1"),
    (dict(batch_size=-1), "batch_size=-1"),
    (dict(precision="fp8"), "precision='fp8' is not supported; allowed: 'fp32'"),
    (dict(optimizer="lion"), "optimizer='lion' is not supported"),
    (dict(zero_stage=4), "zero_stage=4 is not supported; allowed: 0, 1, 2, 3"),
    (dict(recompute="some"), "recompute='some'"),
    (dict(schedule="interleaved-1f1b"), "schedule='interleaved-1f1b' is not supported"),
    (dict(cp=3, seq_len=4096), "cp=3 does not divide seq_len=4096"),
    (dict(model="gpt2", seq_len=2048), "exceeds the 1024 learned positions"),
    (dict(model="nope"), "not a known preset"),
    (dict(model=-5.0), "must be a number > 0"),
])
def test_bad_input(kw, match):
    kw = {"model": "llama2-7b", "seq_len": 1024, **kw}
    with pytest.raises(ValueError, match=match):
        estimate_memory(**kw)


def test_fp32_activations_store_4_byte_values():
    """precision="fp32" runs the forward in fp32: every value Korthikanti et al. count at 2 bytes
    takes 4; the 1-byte dropout masks do not change (10 = 8 + 2, 24, 5 = 4 + 1, full: 2)."""
    spec = get_model("llama2-7b")
    s, b, h, a, L, v = 1024, 2, 4096, 32, 32, 32000
    sbh = s * b * h
    layer = sbh * (18 + 48 + 9 * a * s / h)                # fp32: 8*2+2, 24*2, 4*2+1
    kw = dict(batch_size=b, seq_len=s, implementation="megatron")
    fp32 = estimate_memory(spec, precision="fp32", **kw)
    assert fp32.activations == pytest.approx(L * layer + sbh + 8 * sbh + 4 * s * b * v)
    bf16 = estimate_memory(spec, precision="bf16-mixed", **kw)
    assert bf16.activations == pytest.approx(
        L * activation_bytes_per_layer(s, b, h, a) + sbh + 4 * sbh + 4 * s * b * v)
    full = estimate_memory(spec, precision="fp32", recompute="full", **kw)
    assert full.activations == pytest.approx(L * 4 * sbh + sbh + 8 * sbh + 4 * s * b * v)
    assert "fp32" in fp32.explain["activations"]


def test_cp_attention_core_divides_by_cp_not_cp_squared():
    """With context parallelism a rank keeps s/cp queries, each attending to all s keys: the
    5*a*s^2*b attention-core bytes divide by cp, like every other term."""
    spec = get_model("llama2-7b")
    s, cp, h, a, L, v = 8192, 4, 4096, 32, 32, 32000
    sl = s // cp
    m = estimate_memory(spec, seq_len=s, cp=cp, implementation="megatron")
    layer = sl * h * (34 + 5 * a * s / h)
    assert m.activations == pytest.approx(L * layer + sl * h + 4 * sl * h + 4 * sl * v)
    whole = estimate_memory(spec, seq_len=s, implementation="megatron")
    assert m.activations == pytest.approx(whole.activations / cp)
