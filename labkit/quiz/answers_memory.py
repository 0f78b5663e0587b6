"""Answers of the memory questions (labkit/quiz/data/memory.yaml), computed with labkit.memory,
labkit.models and labkit.hardware. Each returns {"answer": value in the question's unit,
**intermediates} so the explanation can show the arithmetic with the drawn numbers; a choice
question's verify returns {"holds": bool, ...}."""
from __future__ import annotations

import math

from labkit.activations import layer_terms
from labkit.hardware import GPUS
from labkit.memory import (activation_bytes_per_layer, bytes_per_param, estimate_memory,
                           state_bytes)
from labkit.models import get_model

GB = 1e9
MB = 1e6


def states_per_param(precision, optimizer, grad_accum="param"):
    """Bytes of model states per parameter, unsharded, and their split."""
    w, g, o = state_bytes(precision, optimizer, grad_accum)
    return {"answer": bytes_per_param(precision, optimizer, grad_accum), "weight": w, "grad": g,
            "opt": o, "master": 4 if precision.endswith("-mixed") else 0}


def optimizer_states_gb(params_b, precision="bf16-mixed", optimizer="adamw"):
    """Optimizer states (fp32 master weights included) of an unsharded model, GB."""
    m = estimate_memory(params_b * 1e9, precision=precision, optimizer=optimizer)
    per = state_bytes(precision, optimizer)[2]
    return {"answer": m.optimizer_states / GB, "per_param": per,
            "moments_gb": (per - 4) * params_b if precision.endswith("-mixed") else None,
            "seed_per_param": 280 / 70}


def model_states_gb(params_b, precision="bf16-mixed", optimizer="adamw", zero_stage=0, dp=1):
    """Model states (weights + gradients + optimizer states) per GPU, GB."""
    m = estimate_memory(params_b * 1e9, precision=precision, optimizer=optimizer,
                        zero_stage=zero_stage, dp=dp)
    return {"answer": m.model_states / GB, "params_gb": m.params / GB, "grads_gb": m.grads / GB,
            "opt_gb": m.optimizer_states / GB,
            "bytes_per_param": bytes_per_param(precision, optimizer),
            "twelve_gb": 12 * params_b}


def missing_master(params_b, weights_gb, adam_gb, grads_gb):
    """An article's weights + Adam + gradients for a params_b-billion model: is the gap to
    labkit's model states exactly the 4-byte fp32 master copy?"""
    full = estimate_memory(params_b * 1e9).model_states / GB
    claimed = weights_gb + adam_gb + grads_gb
    master = 4 * params_b
    return {"holds": math.isclose(full - claimed, master), "full": full, "claimed": claimed,
            "master": master}


def min_gpus_model_states(model, gpu, precision="bf16-mixed", optimizer="adamw"):
    """GPUs whose memory together holds the model states of `model` (no activations, no
    overhead): ceil(states / memory)."""
    n = get_model(model).num_params()
    states = bytes_per_param(precision, optimizer) * n
    mem = GPUS[gpu].memory
    return {"answer": math.ceil(states / mem), "params_b": n / 1e9, "states_tb": states / 1e12,
            "memory_gb": mem / GB, "ratio": states / mem,
            "round_ratio": bytes_per_param(precision, optimizer) * 70e9 / mem}


def param_count_b(model):
    """Exact parameter count of a preset, in billions, with its breakdown."""
    spec = get_model(model)
    parts = spec.param_breakdown()
    return {"answer": spec.num_params() / 1e9, "layers": spec.num_layers,
            "hidden": spec.hidden_size, "vocab": spec.vocab_size,
            "breakdown": ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in parts.items() if v)}


def activations_layer_mb(seq_len, batch_size, hidden_size, num_heads, tp=1,
                         sequence_parallel=False, recompute="none"):
    """Activation bytes one layer keeps for backward (Korthikanti et al. 2022, Table 2), MB."""
    s, b, h, a, t = seq_len, batch_size, hidden_size, num_heads, tp
    value = activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=sequence_parallel,
                                       recompute=recompute)
    return {"answer": value / MB, "sbh": s * b * h, "attn_term": 5 * a * s / h,
            "attn_term_t": 5 * a * s / (h * t), "bytes": value}


def activations_model_gb(model, seq_len, batch_size, recompute):
    """Activations of all layers of a preset on one GPU (no parallelism), Megatron's count, GB;
    with the model states beside them."""
    spec = get_model(model)
    m = estimate_memory(spec, batch_size=batch_size, seq_len=seq_len, recompute=recompute,
                        implementation="megatron")
    per = activation_bytes_per_layer(seq_len, batch_size, spec.hidden_size, spec.num_heads,
                                     recompute=recompute)
    return {"answer": m.activations / GB, "layers": spec.num_layers, "per_layer_mb": per / MB,
            "layers_gb": spec.num_layers * per / GB,
            "extra_gb": (m.activations - spec.num_layers * per) / GB,
            "states_gb": m.model_states / GB, "h": spec.hidden_size, "a": spec.num_heads}


def kv_cache_not_training(model, seq_len, batch_size):
    """Training stores the keys and values of each layer as activations for the backward (the
    'q, k, v' term), and estimate_memory has no KV-cache term: a KV cache is an inference
    structure for incremental decoding."""
    spec = get_model(model)
    m = estimate_memory(spec, batch_size=batch_size, seq_len=seq_len)
    terms = layer_terms("megatron", "eager", s=seq_len, b=batch_size, h=spec.hidden_size,
                        a=spec.num_heads, value_bytes=2, dropout=True)
    no_cache = not any("cache" in k.lower() for k in m.explain)
    return {"holds": no_cache and terms.get("q, k, v", 0) > 0,
            "terms": ", ".join(k for k in m.explain if k not in ("total", "model_states")),
            "qkv_mb": terms["q, k, v"] / MB, "act_gb": m.activations / GB}
