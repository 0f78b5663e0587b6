"""Number formats from their bit layouts, and the gradient precision a training stack keeps.

    >>> FORMATS["fp8-e4m3"].max, FORMATS["fp8-e5m2"].max          # 448.0, 57344.0
    >>> FORMATS["fp8-e4m3"].max_relative_error                      # 2**-4 = 0.0625
    >>> gradient_bytes(2, "fp32")                                   # (4, 0): Megatron's main_grad

Formats: IEEE 754 and the OCP 8-bit Floating Point specification (2023), every figure computed
from the bit layout (`FloatFormat`); FP8 training: Micikevicius et al. 2022, NVIDIA Transformer
Engine (noted above `FORMATS`). Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import validate


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, `exponent_bits`, `mantissa_bits`, `bias`.
    `finite` marks formats without infinities whose only NaN is the all-ones pattern (E4M3).

    IEEE 754 and the OCP 8-bit Floating Point specification, 2023 (which Transformer Engine and
    torch's float8_e4m3fn / float8_e5m2 follow): 1 sign bit, e exponent bits with bias B, m
    stored mantissa bits (a normal number's leading 1 is implied: m + 1 significant bits; bf16
    stores 7, 8 significant). Every figure is computed from (e, m, B), none typed in:
    - normal numbers (1 + f / 2^m) 2^(E - B) for exponent fields E = 1 .. E_max; subnormals
      (f / 2^m) 2^(1 - B) for E = 0;
    - IEEE-like formats (fp32, bf16, fp16, E5M2) reserve the all-ones exponent for inf and NaN,
      so E_max = 2^e - 2 and the largest value is (2 - 2^-m) 2^(E_max - B);
    - E4M3 ("fn": finite, no inf) uses the all-ones exponent for numbers too and reserves only
      S.1111.111 for NaN: the largest value is (2 - 2^(1-m)) 2^(2^e - 1 - B) = 1.75 x 2^8 = 448;
    - rounding to nearest, a value in the normal range is off by at most half a unit in the last
      place: a relative error of at most 2^-(m+1) (E4M3: 2^-4, E5M2: 2^-3, bf16: 2^-8)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    finite: bool = False

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def max(self) -> float:
        """The largest finite value."""
        m = self.mantissa_bits
        if self.finite:      # all-ones exponent holds numbers; mantissa all ones is NaN
            return (2 - 2.0 ** (1 - m)) * 2.0 ** (2**self.exponent_bits - 1 - self.bias)
        return (2 - 2.0**-m) * 2.0 ** (2**self.exponent_bits - 2 - self.bias)

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """The gap between 1 and the next value, 2^-m (torch.finfo(...).eps)."""
        return 2.0**-self.mantissa_bits

    @property
    def max_relative_error(self) -> float:
        """Round-to-nearest error bound in the normal range, relative to the value: 2^-(m+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)


# FP8 training (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; NVIDIA Transformer
# Engine): matmul inputs are cast to E4M3 in the forward and gradients to E5M2 in the backward,
# each tensor with its own scale; weights, gradients and optimizer states stay as in bf16 mixed
# precision (bf16 weights, fp32 master weights and moments), so the model states do not shrink.
# The matmuls run at the FP8 tensor-core rate, twice the bf16 one on Hopper
# (`labkit.hardware.GPUS["h100-sxm"].flops("fp8")`).
FORMATS: dict[str, FloatFormat] = {f.name: f for f in (
    FloatFormat("fp32", 8, 23, 127),
    FloatFormat("bf16", 8, 7, 127),
    FloatFormat("fp16", 5, 10, 15),
    FloatFormat("fp8-e4m3", 4, 3, 7, finite=True),
    FloatFormat("fp8-e5m2", 5, 2, 15),
)}

GRAD_ACCUM = ("param", "fp32", "both")


def gradient_bytes(weight_bytes: int, grad_accum: str = "param") -> tuple[int, int]:
    """(accumulated, step copy) bytes per parameter for the gradients.

    - "param": gradients in the weights' dtype, accumulated and reduced there; the optimizer
      upcasts on the fly (ZeRO's count, 2 + 2 + 12 = 16 B/param with bf16-mixed Adam).
    - "fp32": gradients accumulated and reduced in an fp32 buffer (Megatron-LM's `main_grad`,
      its default in bf16): 2 + 4 + 12 = 18 B/param.
    - "both": 16-bit gradients plus an fp32 copy that the optimizer step reads (DeepSpeed's ZeRO
      optimizers, Megatron-LM in fp16, the Ultra-Scale Playbook's 2 + 2 + 4 + 4 + 8 = 20
      B/param). The copy belongs to the step, so ZeRO-1 already shards it with the optimizer
      states; the accumulated gradient is sharded from ZeRO-2.
    """
    validate.choice("grad_accum", grad_accum, GRAD_ACCUM)
    if grad_accum == "both" and weight_bytes >= 4:
        raise ValueError("grad_accum='both' adds an fp32 copy of 16-bit gradients; with 4-byte "
                         "weights the gradients are fp32 already; allowed: 'param', 'fp32'")
    if grad_accum == "fp32":
        return 4, 0
    return weight_bytes, (4 if grad_accum == "both" else 0)
