"""Activation bytes a transformer layer keeps for backward, term by term, per implementation.

    >>> layer_terms("hf-llama", s=4096, b=1, h=4096, a=32, kv=8, ffn=14336)   # {term: bytes}

Implementations: "megatron" (Korthikanti et al. 2022, §4.1, Table 2), "hf-gpt2" and "hf-llama"
(transformers' GPT-2 and Llama); attention "eager", "sdpa" or "sdpa-math"; device "cuda" or "cpu"
(whose kernels run: the CPU has no fused dropout, and no fused SDPA with dropout). Each counts
what its code saves,
checked against saved-tensor hooks on real models in tests/cost/test_activations.py (within 5%);
what each keeps is noted above `IMPLEMENTATIONS`, the measured facts behind it in `_terms` and
PROBES.md. Pure Python, no torch import.
"""
from __future__ import annotations

from labkit import validate

# What each implementation keeps:
# - "megatron": Korthikanti et al. 2022 (§4.1, Table 2), a GPT layer as Megatron-LM runs it:
#   multi-head attention, a 4h GELU MLP, 16-bit values, 1-byte dropout masks. Per layer
#   s*b*h*(34 + 5*a*s/h) bytes without parallelism. Kept exactly as the paper has it (GQA and
#   the MLP width are not its variables).
# - "hf-gpt2": transformers' `GPT2LMHeadModel` (config defaults: dropout 0.1, `gelu_new`). Its
#   GELU is the tanh formula written as elementwise ops: five 4h-wide tensors kept, not two.
# - "hf-llama": transformers' `LlamaForCausalLM` (and Mistral, Qwen2: same layer). RMSNorm
#   keeps an fp32 copy of its input (4 bytes per value, whatever the dtype) besides its 16-bit
#   output; SwiGLU keeps four ffn-wide tensors (gate, silu(gate), up, their product); K and V
#   are kept num_kv_heads wide with SDPA, repeated to num_heads wide with eager attention. No
#   dropout by default (attention_dropout 0.0); with it on, only the attention probabilities.
# - "fused": a production Llama-style layer (Megatron-Core / TransformerEngine kernels, what the
#   planner prices by default): fused RMSNorm keeping its 16-bit input and an fp32 rstd per
#   token, FlashAttention (the "sdpa" bytes), fused SwiGLU keeping gate and up (2 ffn-wide) and
#   the down projection's input; no dropout. Not measured here (no such kernels on a CPU):
#   Korthikanti et al.'s accounting applied to those kernels.
IMPLEMENTATIONS = ("megatron", "hf-gpt2", "hf-llama", "fused")
# Attention:
# - "eager": scores are materialised: a*s*s*b values per softmax output (Megatron: 16-bit
#   softmax output, 1-byte dropout mask, dropout output: the 5as/h term; transformers' Llama:
#   the softmax in fp32, 4 bytes, plus its 16-bit copy; GPT-2: softmax output in the dtype,
#   plus the mask and dropped probabilities when dropout is on).
# - "sdpa" (transformers' default, `attn_implementation="sdpa"`; the same bytes as
#   FlashAttention): a fused kernel keeps no scores, only Q, K, V, its output and a per-row
#   log-sum-exp (fp32, 4*a*s*b bytes). CUDA runs it with dropout too.
# - "sdpa-math": torch's SDPA math path, what SDPA runs on a CPU when attention dropout is on
#   (torch 2.13 has no fused CPU kernel with dropout): 16-bit Q, K, V upcast to fp32 (K and V
#   repeated to all a heads), scaled copies of Q and K, fp32 scores: the softmax output, and
#   with dropout its mask and the dropped probabilities, 4 bytes each. device="cpu" picks it.
ATTENTIONS = ("eager", "sdpa", "sdpa-math")
# Whose kernels: "cuda" (F.dropout is the fused kernel: 1-byte masks; SDPA fused with dropout)
# or "cpu" (torch's composite dropout keeps its mask in the activation dtype unless the fused
# kernel is called, `fused_dropout`; SDPA with dropout falls back to the math path).
DEVICES = ("cuda", "cpu")
FP32 = 4


def default_implementation(spec) -> str:
    """The implementation a learner's transformers model of `spec` runs: GPT-2 -> "hf-gpt2",
    every Llama-style spec (RMSNorm, gated MLP) -> "hf-llama"."""
    return "hf-gpt2" if spec.arch == "gpt2" else "hf-llama"


def resolve(implementation, attention, dropout, spec=None, device=None) -> tuple[str, str, bool]:
    """(implementation, attention, dropout) with the defaults filled in: implementation from
    `spec` ("megatron" without one); attention "eager" for Megatron (the paper's table), "sdpa"
    for transformers (its default); dropout on for Megatron and GPT-2 (their defaults), off for
    Llama (attention_dropout 0.0). The attention returned is the kernel that runs: "sdpa" with
    dropout on device "cpu" is "sdpa-math"."""
    if implementation is None:
        implementation = "megatron" if spec is None else default_implementation(spec)
    validate.choice("implementation", implementation, IMPLEMENTATIONS)
    if attention is None:
        attention = "eager" if implementation == "megatron" else "sdpa"
    validate.choice("attention", attention, ATTENTIONS)
    if dropout is None:
        dropout = implementation not in ("hf-llama", "fused")
    validate.choice("dropout", dropout, (True, False))
    if attention == "sdpa" and dropout and _device(device) == "cpu":
        attention = "sdpa-math"
    return implementation, attention, dropout


def _device(device) -> str:
    return validate.choice("device", "cuda" if device is None else device, DEVICES)


def mask_bytes(device=None, fused_dropout=None, value_bytes=2) -> int:
    """Bytes of one dropout-mask value: 1 with the fused kernel (CUDA's, always used there),
    else the activation's own width (torch's composite CPU dropout keeps its random mask as a
    tensor of the input's dtype)."""
    if fused_dropout is None:
        fused_dropout = _device(device) == "cuda"
    validate.choice("fused_dropout", fused_dropout, (True, False))
    return 1 if fused_dropout else value_bytes


def _terms(impl, attention, dropout, h, q, kv, f, a, kv_len, vb, b, mask=1, math_mask=FP32):
    """{name: (bytes per token, how tp splits it)}: "whole" (h-wide, split only by sequence
    parallelism), "split" (per head or ffn-wide), "score" (per attention score, split).

    Measured facts this relies on (CPU, torch 2.13, transformers 5.x; PROBES.md): LayerNorm
    keeps its mean and rstd in the input dtype (CUDA may keep them in fp32: 8/h sbh more);
    GPT-2's SDPA path keeps the fused QKV output plus contiguous copies of K and V, its eager
    path copies of Q, K and V (b > 1); SDPA's output is the output projection's input (one
    storage). `mask`: bytes of a dropout mask value; `math_mask`: of the math path's."""
    mask = mask if dropout else 0
    if impl == "megatron":
        out = {"norm inputs": (2 * vb * h, "whole"), "qkv and mlp inputs": (2 * vb * h, "whole"),
               "dropout masks": (2 * h * mask, "whole"), "q, k, v": (3 * vb * h, "split"),
               "attention output": (vb * h, "split"),
               "gelu input and output": (2 * vb * 4 * h, "split")}
        scores = {"softmax output": vb, "attention dropout mask": mask,
                  "dropout output": vb if dropout else 0}
    elif impl == "hf-gpt2":
        # Q, K, V are views of c_attn's output. Eager attention's matmuls keep contiguous
        # copies of all three (3 values), except with b = 1, where Q stays a view of the whole
        # output (3 values) beside copies of K and V (2); SDPA keeps the same 5.
        qkv = (3 if attention == "eager" and b > 1 else 5) * vb * q
        out = {"norm inputs": (2 * vb * h, "whole"), "norm outputs": (2 * vb * h, "whole"),
               "norm statistics": (4 * vb, "whole"), "dropout masks": (2 * h * mask, "whole"),
               "q, k, v": (qkv, "split"), "attention output": (vb * q, "split"),
               "gelu_new (5 tensors)": (5 * vb * f, "split")}
        scores = {"softmax output": vb, "attention dropout mask": mask,
                  "dropout output": vb if dropout else 0}
    elif impl == "fused":
        out = {"norm inputs": (2 * vb * h, "whole"), "norm statistics (fp32)": (2 * FP32, "whole"),
               "qkv and mlp inputs": (2 * vb * h, "whole"), "q": (vb * q, "split"),
               "k, v": (2 * vb * kv, "split"), "attention output": (vb * q, "split"),
               "swiglu (gate, up, product)": (3 * vb * f, "split")}
        scores = {"softmax output": vb}     # only with attention="eager"
    else:
        kv_kept = kv if attention == "sdpa" else q      # eager repeats K, V to num_heads
        out = {"norm inputs (fp32 copies)": (2 * FP32 * h, "whole"),
               "norm outputs": (2 * 2 * vb * h, "whole"), "norm statistics": (2 * FP32, "whole"),
               "q": (vb * q, "split"), "k, v": (2 * vb * kv_kept, "split"),
               "attention output": (vb * q, "split"), "swiglu (4 tensors)": (4 * vb * f, "split")}
        # softmax in fp32, then a copy in the dtype: dropout (if on) keeps its mask, the matmul
        # with V the dropped probabilities, else the copy itself (none in fp32: the same tensor)
        scores = ({"softmax output (fp32)": FP32, "attention dropout mask": mask,
                   "dropout output": vb} if dropout else
                  {"softmax output (fp32)": FP32, "softmax output copy": vb if vb != FP32 else 0})
    if attention == "sdpa":
        out["log-sum-exp (fp32)"] = (FP32 * a, "split")
    elif attention == "sdpa-math":
        # Q, K, V leave the layer's own copies unsaved: the math path keeps fp32 ones instead
        for name in ("q, k, v", "q", "k, v"):
            out.pop(name, None)
        out["q, k, v (fp32, all heads)"] = (3 * FP32 * q, "split")
        scores = {"softmax output (fp32)": FP32}
        if dropout:
            scores.update({"attention dropout mask (math path)": math_mask,
                           "dropout output (fp32)": FP32})
        out.update({k: (n * a * kv_len, "score") for k, n in scores.items()})
    else:
        out.update({k: (n * a * kv_len, "score") for k, n in scores.items() if n})
    return out


def layer_terms(implementation=None, attention=None, *, s, b, h, a, kv=None, q=None, ffn=None,
                value_bytes=2, dropout=None, tp=1, sequence_parallel=False, recompute="none",
                kv_len=None, device=None, fused_dropout=None) -> dict[str, float]:
    """Bytes one layer keeps for backward, by term, on one tensor-parallel rank.

    s tokens (of this rank), b sequences, hidden h, a query heads, kv key/value heads (default
    a), q = a * head_dim (default h), ffn the MLP width (default 4h), value_bytes 2 (bf16/fp16)
    or 4 (fp32). kv_len: keys each query attends to (default s; all of the sequence with context
    parallelism). tp splits per-head and ffn-wide terms; h-wide terms only with
    sequence_parallel. recompute "selective" drops the score terms (Korthikanti's selective
    recomputation); "full" keeps only the layer's input (value_bytes per value). device "cuda"
    (default) or "cpu": whose kernels (`DEVICES`); fused_dropout: whether F.dropout is the fused
    1-byte-mask kernel (default: on CUDA, where it always is)."""
    implementation, attention, dropout = resolve(implementation, attention, dropout,
                                                 device=device)
    kv, q = (a if kv is None else kv), (h if q is None else q)
    f = 4 * h if ffn is None else ffn
    d = q // a
    split_whole = tp if sequence_parallel else 1
    sb = s * b
    if recompute == "full":
        return {"layer input": value_bytes * sb * h / split_whole}
    terms = _terms(implementation, attention, dropout, h, q, kv * d, f, a,
                   s if kv_len is None else kv_len, value_bytes, b,
                   mask_bytes(device, fused_dropout, value_bytes),
                   1 if _device(device) == "cuda" else FP32)
    out = {}
    for name, (per_token, how) in terms.items():
        if how == "score" and recompute == "selective":
            continue
        out[name] = per_token * sb / (split_whole if how == "whole" else tp)
    return out


def stage_extra_terms(implementation, first, last, *, s, b, h, vocab, value_bytes=2,
                      dropout=True, tp=1, sequence_parallel=False, device=None,
                      fused_dropout=None) -> dict[str, float]:
    """Bytes outside the layers: the embedding's dropout mask on the first stage; on the last
    the final norm's input and output (the head's input) and the fp32 log-softmax of the logits
    that the loss keeps (Korthikanti et al. §4.3 for Megatron: s*b*h mask, 2 values per token,
    4*s*b*v; transformers upcasts the logits to fp32 for the loss the same way; Llama's RMSNorm
    keeps its fp32 copy too)."""
    split = tp if sequence_parallel else 1
    sb = s * b
    out = {}
    if first and dropout and implementation != "hf-llama":     # Llama: attention dropout only
        out["embedding dropout mask"] = sb * h * mask_bytes(device, fused_dropout,
                                                            value_bytes) / split
    if last:
        norm = (FP32 * h + 2 * value_bytes * h + FP32 if implementation == "hf-llama"
                else 2 * value_bytes * h + FP32 if implementation == "fused"
                else 2 * value_bytes * h + (4 * value_bytes if implementation == "hf-gpt2" else 0))
        out["final norm"] = sb * norm / split
        out["log-softmax of the logits (fp32)"] = FP32 * sb * vocab / tp
    return out


def describe(implementation, attention, dropout, device=None) -> str:
    """A short phrase naming what the activation figures assume."""
    what = {"megatron": "Korthikanti et al. 2022 (Megatron GPT layer)",
            "hf-gpt2": "transformers GPT-2 (gelu_new)",
            "hf-llama": "transformers Llama (RMSNorm fp32 copy, SwiGLU)",
            "fused": "production fused kernels (Megatron-Core / TransformerEngine)"}[implementation]
    drop = ", dropout" if dropout else ", no dropout"
    where = "" if device is None else f", {device} kernels"
    return f"{what}, {attention} attention{drop}{where}"
