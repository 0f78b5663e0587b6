"""Answers of the precision questions (labkit/quiz/data/precision.yaml), computed from the bit
layouts in labkit.precision.FORMATS, labkit.memory and labkit.hardware."""
from __future__ import annotations

import math

from labkit.hardware import GPUS
from labkit.memory import bytes_per_param
from labkit.precision import FORMATS


def _layout(fmt):
    f = FORMATS[fmt]
    return {"e": f.exponent_bits, "m": f.mantissa_bits, "bias": f.bias, "bits": f.bits}


def max_value(fmt):
    """Largest finite value of a format."""
    f = FORMATS[fmt]
    return {"answer": f.max, **_layout(fmt), "finite": f.finite}


def epsilon(fmt):
    """Gap between 1 and the next representable number, 2^-m."""
    f = FORMATS[fmt]
    return {"answer": f.epsilon, **_layout(fmt), "rel": f.max_relative_error}


def min_normal(fmt):
    """Smallest positive normal number, 2^(1 - bias)."""
    f = FORMATS[fmt]
    return {"answer": f.min_normal, **_layout(fmt), "sub": f.min_subnormal}


def loss_scale(grad_exp):
    """Smallest power-of-two loss scale that lifts a gradient of 10**grad_exp to fp16's smallest
    normal number (below it, fp16 loses precision and then flushes to zero)."""
    g = 10.0 ** grad_exp
    fp16 = FORMATS["fp16"]
    scale = 2.0 ** math.ceil(math.log2(fp16.min_normal / g))
    return {"answer": scale, "log2": int(math.log2(scale)), "min_normal": fp16.min_normal,
            "sub": fp16.min_subnormal, "scaled": g * scale,
            "bf16_ok": g >= FORMATS["bf16"].min_normal}


def bf16_needs_no_scaling(grad_exp):
    """bf16 has fp32's 8 exponent bits (its range), fp16 only 5: a gradient of 10**grad_exp is
    below fp16's smallest subnormal but a normal bf16 number."""
    g = 10.0 ** grad_exp
    bf16, fp16, fp32 = FORMATS["bf16"], FORMATS["fp16"], FORMATS["fp32"]
    return {"holds": bf16.exponent_bits == fp32.exponent_bits and g < fp16.min_subnormal
            and g >= bf16.min_normal, "fp16_sub": fp16.min_subnormal,
            "bf16_min": bf16.min_normal, "fp16_max": fp16.max, "bf16_max": bf16.max}


def fp8_roles():
    """E4M3 has the finer mantissa (forward: weights, activations), E5M2 the wider range
    (backward: gradients)."""
    a, b = FORMATS["fp8-e4m3"], FORMATS["fp8-e5m2"]
    return {"holds": b.max > a.max and a.max_relative_error < b.max_relative_error,
            "e4m3_max": a.max, "e5m2_max": b.max, "e4m3_err": a.max_relative_error,
            "e5m2_err": b.max_relative_error}


def bf16_reduce_loses_bits(count):
    """Summing `count` equal bf16 values: once the running sum reaches 2^(m+1) times the value,
    adding one more rounds away (the value is below half a unit in the last place)."""
    bf16 = FORMATS["bf16"]
    lost_at = 2 ** (bf16.mantissa_bits + 1)
    return {"holds": count > lost_at and bf16.epsilon > FORMATS["fp32"].epsilon,
            "lost_at": lost_at, "rel": bf16.max_relative_error, "m": bf16.mantissa_bits}


def fp8_states_same():
    """FP8 training (Transformer Engine) keeps bf16-mixed's model states."""
    fp8, bf16 = bytes_per_param("fp8-mixed", "adamw"), bytes_per_param("bf16-mixed", "adamw")
    return {"holds": fp8 == bf16, "fp8": fp8, "bf16": bf16,
            "speedup": GPUS["h100-sxm"].flops("fp8") / GPUS["h100-sxm"].flops("bf16")}


def fp8_speedup(gpu):
    """Dense FP8 / BF16 tensor-core peak of a GPU."""
    g = GPUS[gpu]
    return {"answer": g.flops("fp8") / g.flops("bf16"), "fp8_t": g.flops("fp8") / 1e12,
            "bf16_t": g.flops("bf16") / 1e12}
