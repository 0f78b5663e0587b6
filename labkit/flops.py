"""Training FLOPs and utilisation (MFU, HFU). Pure Python.

    >>> flops_per_token("llama2-7b", seq_len=4096)      # 6N + 12 L (a d_head) s, model FLOPs
    >>> mfu("llama2-7b", tokens_per_second=3000, gpu="h100-sxm")

Per token a training step costs 6N + 12 L (a d_head) s FLOPs: 6N from Kaplan et al. 2020
(§2.1), the attention term from PaLM (Chowdhery et al. 2022, Appendix B). MFU = model FLOPs
achieved / peak (PaLM, Appendix B); HFU also counts recomputation (Korthikanti et al. 2022, §6).
What each term counts, and what it leaves out: `flops_per_token`.
"""
from __future__ import annotations

import numbers

from labkit import validate
from labkit.hardware import get_gpu
from labkit.models import get_model

RECOMPUTE = ("none", "selective", "full")


def _matmul_params(model) -> tuple[float, object]:
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        return validate.positive("model (parameter count)", model, validate.MAX_PARAMS), None
    spec = get_model(model)
    # Drop the lookup tables; keep the head's matmul (a separate tensor already in num_params(),
    # or the tied embedding used a second time as the head). A mixture of experts: the
    # parameters a token uses (`active_params`: k of the routed experts), as DeepSeek-V3 and
    # Megatron-LM count an MoE's FLOPs.
    n = spec.active_params() - spec.embedding_params()
    if spec.tied_embeddings:
        n += spec.vocab_size * spec.hidden_size
    return float(n), spec


def attention_flops_per_token(model, seq_len, causal=False) -> float:
    """Forward attention-score FLOPs per token: 4 * L * (a * d_head) * s (halved if causal);
    with MLA, a * (d_qk + d_v) / 2 for a * d_head (`ModelSpec.score_width`)."""
    spec = get_model(model)
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    f = 4 * spec.num_layers * spec.score_width * s
    return f / 2 if causal else float(f)


def flops_per_token(model, seq_len=None, causal=False, recompute="none",
                    hardware=False) -> float:
    """Training FLOPs per token: model FLOPs 6N + 3 * attention, or (hardware=True) what the
    GPU executes including recomputation. `model` may be a plain parameter count (then 6N
    only: no shapes, no attention term).

        6 * N  +  12 * L * (a * d_head) * s          FLOPs  (model FLOPs)

    - 6N: every parameter used in a matrix multiply costs 2 FLOPs per token forward and 4
      backward (Kaplan et al. 2020, §2.1); for a mixture of experts N is the active
      parameters (`ModelSpec.active_params`), the MFU DeepSeek-V3 and Megatron-LM report. N here counts the LM head (a real matmul, tied or
      not) and leaves out the embedding lookups (a gather, no FLOPs); norms and biases are
      counted too (tiny).
    - 12 L a d_head s: the attention scores Q K^T and their product with V, 4 * s * a * d_head
      FLOPs per token per layer forward, times 3 for training (Chowdhery et al. 2022, PaLM,
      Appendix B; the same term appears in Narayanan et al. 2021, eq. 3). Causal masking is not
      discounted, as in PaLM and Megatron-LM; Kaplan et al. count half (2 n_layer n_ctx d_attn
      forward); pass `causal=True` for that convention.
    - hardware=True (HFU's count, Korthikanti et al. 2022, §6): full recompute repeats the
      layers' forward (+ 2 N_layers + 4 L a d_head s per token, Narayanan et al. 2021's
      96 B s l h^2 form; the head is not recomputed); selective recompute repeats only the
      attention core (+ 4 L a d_head s, or half that with `causal=True`)."""
    validate.choice("recompute", recompute, RECOMPUTE)
    n, spec = _matmul_params(model)
    attn = 0.0
    if spec is not None:
        s = spec.max_seq_len if seq_len is None else seq_len
        attn = attention_flops_per_token(spec, s, causal)
    total = 6 * n + 3 * attn
    if hardware:
        if recompute == "full":
            # one more forward of the transformer layers (the embedding, final norm and head
            # sit outside the checkpointed layers and are not recomputed)
            layers = n if spec is None else (
                spec.active_params() - spec.embedding_params() - spec.lm_head_params()
                - spec.final_norm_params())
            total += 2 * layers + attn
        elif recompute == "selective":
            total += attn                  # the attention core again
    return total


def flops_per_step(model, batch_size, seq_len=None, causal=False, recompute="none",
                   hardware=False) -> float:
    """Training FLOPs of one step over `batch_size` sequences (the global batch) of seq_len."""
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    if seq_len is None and isinstance(model, numbers.Real) and not isinstance(model, bool):
        raise ValueError(f"seq_len=None needs a model with a context length; with model={model!r}"
                         " (a parameter count) pass seq_len, a whole number >= 1")
    spec_len = seq_len if seq_len is not None else get_model(model).max_seq_len
    s = validate.positive_int("seq_len", spec_len, validate.MAX_SEQ_LEN)
    return flops_per_token(model, s, causal, recompute, hardware) * b * s


def mfu(model, tokens_per_second, gpu, num_gpus=1, seq_len=None, dtype="bf16",
        causal=False) -> float:
    """Model FLOPs utilisation: model FLOPs per token x tokens/s / (num_gpus x dense peak)."""
    tps = validate.positive("tokens_per_second", tokens_per_second,
                            validate.MAX_TOKENS_PER_SECOND)
    g = validate.positive_int("num_gpus", num_gpus, validate.MAX_RANKS)
    peak = get_gpu(gpu).flops(dtype)
    return flops_per_token(model, seq_len, causal) * tps / (g * peak)


def hfu(model, tokens_per_second, gpu, num_gpus=1, seq_len=None, dtype="bf16",
        causal=False, recompute="none") -> float:
    """Hardware FLOPs utilisation: like MFU but counting recomputed FLOPs (HFU >= MFU)."""
    tps = validate.positive("tokens_per_second", tokens_per_second,
                            validate.MAX_TOKENS_PER_SECOND)
    g = validate.positive_int("num_gpus", num_gpus, validate.MAX_RANKS)
    peak = get_gpu(gpu).flops(dtype)
    return flops_per_token(model, seq_len, causal, recompute, hardware=True) * tps / (g * peak)


def megatron_flops_per_step(batch_size, seq_len, num_layers, hidden_size, vocab_size,
                            recompute="full") -> float:
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full
    recompute (4 passes), or 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without (3 passes). For a
    GPT layer with no biases or norms; a cross-check of `flops_per_step`."""
    B, s, l, h, V = (validate.positive_int(k, v, at_most) for k, v, at_most in
                     (("batch_size", batch_size, validate.MAX_BATCH),
                      ("seq_len", seq_len, validate.MAX_SEQ_LEN),
                      ("num_layers", num_layers, validate.MAX_LAYERS),
                      ("hidden_size", hidden_size, validate.MAX_WIDTH),
                      ("vocab_size", vocab_size, validate.MAX_WIDTH)))
    validate.choice("recompute", recompute, ("none", "full"))
    if recompute == "full":
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
