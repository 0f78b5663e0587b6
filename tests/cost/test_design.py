"""labkit.design: the interview's design cases, each number checked by an independent closed form
(written out here from the model's shape and the datasheet's peak) or by a second labkit route
(the planner's throughput against the MFU formula, `evaluate` against `plan`)."""
from __future__ import annotations

from labkit.kernels import matmul_efficiency

import math

import pytest

from labkit import design, resilience
from labkit.hardware import GPUS, LINKS
from labkit.models import get_model
from labkit.planner import evaluate

H100 = GPUS["h100-sxm"]


def model_flops_per_token(name, s):
    """6N (matmul parameters: no embedding lookup, the head counted) + 12 L (a d_head) s."""
    spec = get_model(name)
    n = spec.num_params() - spec.embedding_params()
    if spec.tied_embeddings:
        n += spec.vocab_size * spec.hidden_size
    return 6 * n + 12 * spec.num_layers * spec.num_heads * spec.d_head * s


@pytest.fixture(scope="module")
def run70():
    return design.pretraining_run("llama3-70b", gpus=512, gpu="h100-sxm", days=30)


def test_tokens_follow_from_mfu_and_from_throughput(run70):
    """tokens = days x 86,400 x gpus x peak x MFU / FLOPs per token, and = tokens/s x seconds."""
    fpt = model_flops_per_token("llama3-70b", 8192)
    assert run70.flops_per_token == pytest.approx(fpt, rel=1e-12)
    peak = H100.peak_flops["bf16"]
    closed = 30 * 86_400 * 512 * peak * run70.mfu / fpt
    assert run70.tokens == pytest.approx(closed, rel=1e-9)
    assert run70.tokens == pytest.approx(run70.tokens_per_second * 30 * 86_400, rel=1e-9)
    # MFU from the plan's own step: model FLOPs of the step / (gpus x peak x step time)
    step_flops = fpt * run70.inputs["global_batch"] * 8192
    assert run70.mfu == pytest.approx(step_flops / (512 * peak * run70.step_time), rel=1e-9)
    assert 0.2 < run70.mfu < run70.inputs["matmul_efficiency"]    # comm and bubble cost some


def test_chinchilla_and_the_gpus_it_needs(run70):
    n = get_model("llama3-70b").num_params()
    assert run70.chinchilla_tokens == 20 * n
    per_gpu = run70.tokens / 512
    assert run70.gpus_for_chinchilla == math.ceil(20 * n / per_gpu)
    assert (run70.gpus_for_chinchilla - 1) * per_gpu < 20 * n <= run70.gpus_for_chinchilla * per_gpu
    assert run70.chinchilla_days == pytest.approx(30 * 20 * n / run70.tokens, rel=1e-9)


def test_layout_fits_all_gpus_and_is_priced_as_evaluate_prices_it(run70):
    lay = run70.layout
    assert lay.gpus == 512 and lay.cp == 1                   # CP left off at 8k tokens
    assert run70.memory <= H100.memory
    again = evaluate("llama3-70b", lay, gpu="h100-sxm", global_batch=512, seq_len=8192)
    assert again.memory == pytest.approx(run70.memory, rel=1e-12)
    assert again.step_time == pytest.approx(run70.step_time, rel=1e-12)


def test_checkpoints_and_failures_closed_form(run70):
    n = get_model("llama3-70b").num_params()
    size = 12 * n                                            # fp32 weights + AdamW's two moments
    write = size / 100e9
    mtbf = 86_400 / (512 * 1e-4)
    tau = math.sqrt(2 * write * mtbf)
    assert run70.checkpoint_bytes == size
    assert run70.write_seconds == pytest.approx(write, rel=1e-12)
    assert run70.mtbf == pytest.approx(mtbf, rel=1e-12)
    assert run70.interval == pytest.approx(tau, rel=1e-12)
    assert run70.overhead == pytest.approx(math.sqrt(2 * write / mtbf), rel=1e-9)  # Young's optimum
    assert run70.expected_failures == pytest.approx(512 * 1e-4 * 30, rel=1e-12)
    assert run70.goodput_tokens == pytest.approx(run70.tokens * (1 - run70.overhead), rel=1e-12)


def test_at_llama3s_measured_rate(run70):
    """The scenario's 0.01 %/GPU/day beside Llama 3's measured 419 / (54 x 16,384) = 0.047 %:
    the same run re-worked equals a fresh design at that rate, in closed form."""
    rate = 419 / (54 * 16_384)
    at = run70.at_failure_rate(resilience.LLAMA3_FAILURE_RATE)
    fresh = design.pretraining_run("llama3-70b", gpus=512, gpu="h100-sxm", days=30,
                                   daily_failure_rate=resilience.LLAMA3_FAILURE_RATE)
    mtbf = 86_400 / (512 * rate)
    for got in (at, fresh):
        assert got.mtbf == pytest.approx(mtbf, rel=1e-12)                    # 99 h, not 469
        assert got.interval == pytest.approx(math.sqrt(2 * run70.write_seconds * mtbf))
        assert got.overhead == pytest.approx(math.sqrt(2 * run70.write_seconds / mtbf))
        assert got.expected_failures == pytest.approx(512 * rate * 30)       # 7.3, not 1.5
        assert got.tokens == run70.tokens and got.layout == run70.layout
    assert (at.mtbf, at.interval, at.overhead) == pytest.approx(
        (fresh.mtbf, fresh.interval, fresh.overhead), rel=1e-12)
    assert run70.inputs["daily_failure_rate"] == design.SCENARIO_FAILURE_RATE == 1e-4
    assert "0.047%/GPU/day" in at.summary() and "0.010%/GPU/day" in run70.summary()


def test_summary_shows_each_number_with_its_unit(run70):
    text = run70.summary()
    for piece in (f"{run70.memory / 1e9:.1f} GB", f"{run70.step_time:.2f} s",
                  f"{run70.tokens / 1e12:.2f}T", f"{run70.interval / 60:.1f} min",
                  str(run70.layout)):
        assert piece in text, piece


def test_restart_time_adds_its_share():
    base = design.pretraining_run("llama3-8b", gpus=64, days=1)
    slow = design.pretraining_run("llama3-8b", gpus=64, days=1, restart_seconds=600)
    assert slow.overhead - base.overhead == pytest.approx(600 / base.mtbf, rel=1e-9)


def test_finetune_model_states_per_stage_closed_form():
    ft = design.finetune_run("llama3-8b", gpus=8)
    n, dp = get_model("llama3-8b").num_params(), 8
    states = {0: 16 * n, 1: (2 + 2 + 12 / dp) * n, 2: (2 + 14 / dp) * n, 3: 16 * n / dp}
    for stage, want in states.items():
        for rc in ("none", "selective", "full"):
            assert ft.option(stage, rc).model_states == pytest.approx(want, rel=1e-12)
    assert not ft.option(0, "full").fits                      # 16 B/param x 8B > 80 GB
    first = ft.first_fit
    assert first.fits and all(not o.fits for o in ft.options[:ft.options.index(first)])
    assert ft.option(3, "full").total < ft.option(3, "none").total
    assert ft.hours == pytest.approx(1e9 / ft.estimate.tokens_per_second / 3600, rel=1e-12)
    assert ft.estimate.layout.gpus == 8 and ft.estimate.fits
    assert "out of scope" in ft.lora
    with pytest.raises(ValueError, match="no option zero_stage=4"):
        ft.option(4)


@pytest.fixture(scope="module")
def long8b():
    return design.long_context_run("llama3-8b", seq_len=2**20)


def test_long_context_activations_divide_by_cp_and_the_smallest_fit(long8b):
    rows = long8b.rows
    assert [r.cp for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    for r in rows[1:]:
        assert rows[0].activations / r.activations == pytest.approx(r.cp, rel=1e-9)
        assert r.gpus == 8 * r.cp
    need = long8b.needed
    assert need.fits and all(not r.fits for r in rows[:rows.index(need)])
    assert need.cp > 1                                       # 1M tokens do not fit on tp=8 alone


def test_ring_attention_hop_closed_form(long8b):
    spec, s, c, t = get_model("llama3-8b"), 2**20, long8b.needed.cp, 8
    x = s // c                                               # tokens per CP rank
    hop = 2 * x * spec.kv_size / t * 2                       # K and V, bf16, this tp slice
    assert long8b.hop_bytes == hop
    link = LINKS["ib-ndr"]                                   # tp x cp > 8: across nodes
    assert long8b.link == link.name
    assert long8b.hop_seconds == pytest.approx(link.latency + hop / link.bandwidth, rel=1e-12)
    eff = long8b.inputs["matmul_efficiency"]
    assert eff == matmul_efficiency(H100)                   # default: what kernels prices
    compute = 4 * spec.q_size * x * x / t / (H100.peak_flops["bf16"] * eff)
    assert long8b.hop_compute == pytest.approx(compute, rel=1e-12)
    assert long8b.hidden
    # 2 x kv / t x 2 B / B_link  =  4 q x / t / (P e)  at  x = kv P e / (q B_link)
    even = spec.kv_size * H100.peak_flops["bf16"] * eff / (spec.q_size * link.bandwidth)
    assert long8b.min_tokens_per_rank == pytest.approx(even, rel=1e-9)
    assert long8b.sends_per_step == (c - 1) * 4 * spec.num_layers   # full recompute: 4 per layer
    share = 12 * spec.num_layers * spec.q_size * s / model_flops_per_token("llama3-8b", s)
    assert long8b.attention_share == pytest.approx(share, rel=1e-12) and share > 0.9


@pytest.mark.parametrize("call, words", [
    (lambda: design.pretraining_run(days=0), "days=0"),
    (lambda: design.pretraining_run(global_batch_tokens=4096), "global_batch_tokens=4,096"),
    (lambda: design.pretraining_run("llama3-405b", gpus=8, days=1), "no layout of llama3-405b"),
    (lambda: design.long_context_run(seq_len=1_000_001), "tp=8 does not divide seq_len"),
    (lambda: design.long_context_run(recompute="some"), "recompute"),
    (lambda: design.trainable_tokens("llama3-8b", 8, "h100-sxm", 1, mfu=1.5), "mfu"),
    (lambda: design.gpus_for_tokens("llama3-8b", -1, "h100-sxm", 1, 0.4), "tokens"),
])
def test_bad_input_names_the_argument(call, words):
    with pytest.raises(ValueError, match=words):
        call()
