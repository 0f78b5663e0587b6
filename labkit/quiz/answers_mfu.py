"""Answers of the MFU, throughput and training-time questions (labkit/quiz/data/mfu.yaml).

FLOPs per token from `labkit.flops.flops_per_token`: 6N (Kaplan et al. 2020) plus the attention
scores' 12 L (a d_head) s (PaLM, Appendix B), and with hardware=True the recomputed forward;
MFU and HFU from `labkit.flops.mfu` / `hfu`; dense peaks from `labkit.hardware.GPUS`. Time at an
MFU: FLOPs / (GPUs x peak x MFU). MFU is given and returned in % (40, not 0.4).
"""
from __future__ import annotations

from labkit.flops import attention_flops_per_token, flops_per_step, flops_per_token, hfu, mfu
from labkit.hardware import get_gpu
from labkit.models import get_model
from labkit.resilience import DAY

# Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", Chinchilla): about
# 20 training tokens per parameter at the compute-optimal point. A stated rule of thumb (their
# Table 3 fits give 20.2 for 1e21-1e24 FLOP budgets), not derived here.
CHINCHILLA_TOKENS_PER_PARAM = 20
GFLOP, HOUR = 1e9, 3600.0


def _peak(gpu, dtype="bf16") -> float:
    return get_gpu(gpu).flops(dtype)


def flops_6n_gflop(params_b):
    """Training GFLOP per token of a params_b-billion-parameter model by the 6N rule."""
    n = params_b * 1e9
    return {"answer": flops_per_token(n) / GFLOP, "fwd": 2 * params_b, "bwd": 4 * params_b}


def flops_per_token_gflop(model, seq_len):
    """Training GFLOP per token: 6N over the matmul parameters + 3 x 4 L (a d_head) s."""
    spec = get_model(model)
    total = flops_per_token(spec, seq_len)
    attn = 3 * attention_flops_per_token(spec, seq_len)      # forward + backward (2x forward)
    six_n = total - attn
    return {"answer": total / GFLOP, "six_n": six_n / GFLOP, "attn": attn / GFLOP,
            "attn_pct": 100 * attn / total, "L": spec.num_layers, "q": spec.q_size}


def attention_share_pct(model, seq_len):
    """Share of the training FLOPs per token spent on the attention scores, in %."""
    out = flops_per_token_gflop(model, seq_len)
    return {**out, "answer": out["attn_pct"], "total": out["answer"]}


def mfu_pct(model, seq_len, tokens_per_s_per_gpu, gpu="h100-sxm", gpus=1):
    """MFU in % from the measured tokens/s of each GPU."""
    u = mfu(model, tokens_per_s_per_gpu * gpus, gpu, gpus, seq_len)
    f = flops_per_token(model, seq_len)
    return {"answer": 100 * u, "gflop": f / GFLOP, "achieved_tflops": f * tokens_per_s_per_gpu
            / 1e12, "peak_tflops": _peak(gpu) / 1e12}


def hfu_at_mfu_pct(model, seq_len, mfu_pct, gpu="h100-sxm"):
    """HFU in % of a run with full activation recomputation whose MFU is mfu_pct."""
    model_f = flops_per_token(model, seq_len)
    hw_f = flops_per_token(model, seq_len, recompute="full", hardware=True)
    tps = mfu_pct / 100 * _peak(gpu) / model_f            # tokens/s per GPU at that MFU
    return {"answer": 100 * hfu(model, tps, gpu, 1, seq_len, recompute="full"),
            "ratio": hw_f / model_f, "model_gflop": model_f / GFLOP, "hw_gflop": hw_f / GFLOP}


def verify_hfu_not_mfu(model, seq_len, gpu="a100-80gb"):
    """At the same throughput HFU equals MFU without recomputation and exceeds it with full
    recomputation (by the recomputed forward, about a third)."""
    tps = 0.4 * _peak(gpu) / flops_per_token(model, seq_len)   # any throughput: ratios only
    m = mfu(model, tps, gpu, 1, seq_len)
    h_none = hfu(model, tps, gpu, 1, seq_len, recompute="none")
    h_full = hfu(model, tps, gpu, 1, seq_len, recompute="full")
    holds = abs(h_none - m) <= 1e-12 * m and h_full > m
    return {"holds": holds, "ratio": h_full / m, "sel_ratio": hfu(
        model, tps, gpu, 1, seq_len, recompute="selective") / m}


def step_time_s(model, gpus, global_batch, seq_len, mfu_pct, gpu="h100-sxm"):
    """Seconds per step: the step's model FLOPs / (GPUs x peak x MFU)."""
    f = flops_per_step(model, global_batch, seq_len)
    rate = gpus * _peak(gpu) * mfu_pct / 100
    return {"answer": f / rate, "pflop": f / 1e15, "rate_pflops": rate / 1e15,
            "tokens": global_batch * seq_len}


def tokens_per_day_b(model, gpus, mfu_pct, seq_len, gpu="h100-sxm"):
    """Billions of tokens a day at an MFU."""
    f = flops_per_token(model, seq_len)
    tps = gpus * _peak(gpu) * mfu_pct / 100 / f
    return {"answer": tps * DAY / 1e9, "tps": tps, "gflop": f / GFLOP, "day_s": DAY,
            "peak_tflops": _peak(gpu) / 1e12}


def days_to_train(model, tokens_t, gpus, mfu_pct, seq_len, gpu="h100-sxm"):
    """Days to train on tokens_t trillion tokens at an MFU."""
    f = flops_per_token(model, seq_len)
    total = tokens_t * 1e12 * f
    rate = gpus * _peak(gpu) * mfu_pct / 100
    return {"answer": total / rate / DAY, "total_flop": total, "gflop": f / GFLOP,
            "rate_pflops": rate / 1e15}


def chinchilla_tokens_b(model):
    """Compute-optimal training tokens by the Chinchilla rule, in billions."""
    n = get_model(model).num_params()
    return {"answer": CHINCHILLA_TOKENS_PER_PARAM * n / 1e9, "params_b": n / 1e9,
            "rule": CHINCHILLA_TOKENS_PER_PARAM}


def chinchilla_gpu_hours(model, mfu_pct, gpu="h100-sxm"):
    """GPU-hours to train `model` on its Chinchilla-optimal tokens at an MFU (model context)."""
    spec = get_model(model)
    tokens = CHINCHILLA_TOKENS_PER_PARAM * spec.num_params()
    f = flops_per_token(spec)
    hours = tokens * f / (_peak(gpu) * mfu_pct / 100) / HOUR
    return {"answer": hours, "tokens_b": tokens / 1e9, "gflop": f / GFLOP,
            "rule": CHINCHILLA_TOKENS_PER_PARAM, "seq_len": spec.max_seq_len,
            "peak_tflops": _peak(gpu) / 1e12}


def reported_hfu_to_mfu(model, seq_len, achieved_tflops, gpu="a100-80gb"):
    """MFU in % of a run that reports `achieved_tflops` per GPU counting the recomputed forward
    (full recomputation, as Megatron-LM's eq. 3 does)."""
    hw_f = flops_per_token(model, seq_len, recompute="full", hardware=True)
    tps = achieved_tflops * 1e12 / hw_f
    return {"answer": 100 * mfu(model, tps, gpu, 1, seq_len),
            "hfu": 100 * hfu(model, tps, gpu, 1, seq_len, recompute="full"),
            "ratio": hw_f / flops_per_token(model, seq_len), "peak_tflops": _peak(gpu) / 1e12}
