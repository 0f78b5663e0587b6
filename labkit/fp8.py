"""FP8 numerics measured on a CPU: E4M3 and E5M2, amax scaling per tensor, row, 1x128 tile or
128x128 block, on real activations (with outlier channels), weights and gradients.

    >>> format_table()                                   # torch.finfo facts of both formats
    >>> q, s = quantize(x, "e4m3", "block1x128"); dequantize(q, s, "block1x128", x.shape)
    >>> rows = compare(capture()); print(table(rows))    # error, underflow, overflow per case
    >>> memory_table("llama2-7b")                        # what FP8 saves, from labkit.memory

Sources: DeepSeek-V3 technical report §3.3 (fine-grained 1x128 / 128x128 scaling);
Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; NVIDIA Transformer Engine docs.
torch is imported inside the functions only (docs/fp8.md has what is measured and why).
"""
from __future__ import annotations

import math

from labkit import validate

DTYPES = ("e4m3", "e5m2")
SCALINGS = ("none", "tensor", "row", "block1x128", "block128x128")
TILE = 128                # DeepSeek-V3's group size along each scaled dimension
AMAX_FLOOR = 1e-12        # an all-zero group gets a finite scale (its values stay 0)


def _dtype(name):
    import torch
    validate.choice("dtype", name, DTYPES)
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]


def formats() -> dict:
    """{"e4m3": {...}, "e5m2": {...}}, every number from torch.finfo or a measured cast."""
    import torch
    out = {}
    for name in DTYPES:
        d, fi = _dtype(name), torch.finfo(_dtype(name))
        m = round(-math.log2(fi.eps))                      # eps = 2^-mantissa_bits
        over = torch.tensor([2 * fi.max, math.inf]).to(d).float().tolist()
        out[name] = {"torch": str(d), "max": fi.max, "smallest_normal": fi.smallest_normal,
                     "smallest_subnormal": fi.smallest_normal * fi.eps, "mantissa_bits": m,
                     "exponent_bits": fi.bits - 1 - m, "relative_step": fi.eps,
                     "dynamic_range": fi.max / (fi.smallest_normal * fi.eps),
                     "2*max casts to": over[0], "inf casts to": over[1]}
    return out


def __getattr__(name):          # FORMATS is computed on first use: importing needs no torch
    if name == "FORMATS":
        return formats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def format_table() -> list[dict]:
    return [{"format": k, **v} for k, v in formats().items()]


def _check(x, dtype, scaling):
    import torch
    validate.choice("dtype", dtype, DTYPES)
    validate.choice("scaling", scaling, SCALINGS)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype.itemsize < 2:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor of float64, float32, bfloat16 or float16; got {got}")
    if x.numel() == 0:
        raise ValueError("x is empty; allowed: a tensor with at least one value")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x has inf or NaN values; allowed: finite values only")
    return x.detach().float().reshape(-1, x.shape[-1] if x.dim() else 1)


def _expand(scales, scaling, rows, cols):
    """Scales (row groups, column groups) repeated to one per value of a rows x cols matrix."""
    r = TILE if scaling == "block128x128" else (1 if scaling in ("row", "block1x128") else rows)
    c = TILE if scaling.startswith("block") else cols
    return scales.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def quantize(x, dtype="e4m3", scaling="tensor"):
    """(q, scales): q an FP8 tensor of x's shape, scales float32 (row groups, column groups),
    one per group: scale = FP8 max / amax(group), q = fp8(clamp(x * scale, -max, max)).

    Groups (on x as a matrix: leading dims flattened into rows, DeepSeek-V3 §3.3.1): "tensor"
    one, "row" one per row (per token / output channel), "block1x128" 1 row x 128 columns
    (activations), "block128x128" 128 x 128 (weights). A dimension that 128 does not divide ends
    in a partial group: the same as zero padding, since zeros do not change amax. "none": no
    scale (all ones) and torch's own cast of out-of-range values (see `formats()`)."""
    import torch
    x2 = _check(x, dtype, scaling)
    d, rows, cols = _dtype(dtype), *x2.shape
    fmax = torch.finfo(d).max
    if scaling == "none":
        return x2.to(d).reshape(x.shape), torch.ones(1, 1)
    a = x2.abs()
    if scaling == "tensor":
        amax = a.amax().reshape(1, 1)
    elif scaling == "row":
        amax = a.amax(1, keepdim=True)
    else:
        tall = TILE if scaling == "block128x128" else 1
        pad = torch.nn.functional.pad(a, (0, -cols % TILE, 0, -rows % tall))
        amax = pad.reshape(pad.shape[0] // tall, tall, -1, TILE).amax((1, 3))
    scales = fmax / amax.clamp(min=AMAX_FLOOR)
    scaled = x2 * _expand(scales, scaling, rows, cols)
    return scaled.clamp(-fmax, fmax).to(d).reshape(x.shape), scales


def dequantize(q, scales, scaling, shape):
    """float32 values of `shape`: q / scale of each value's group."""
    validate.choice("scaling", scaling, SCALINGS)
    shape = tuple(shape)
    q2 = q.float().reshape(-1, shape[-1] if shape else 1)
    return (q2 / _expand(scales, scaling, *q2.shape)).reshape(shape)


def error_stats(x, scaling="tensor", dtype="e4m3") -> dict:
    """rel_error ||x - dq(q(x))|| / ||x|| (the large values weigh most), mean_rel_error (the
    mean of |x - dq| / |x| over nonzero x: every value counts alike), max_abs_error; the shares
    of the nonzero values that overflowed (|x * scale| > max: only without scaling), underflowed
    (dequantized to 0) and landed in the subnormal range (nonzero, below the smallest normal)."""
    import torch
    q, scales = quantize(x, dtype, scaling)
    x64, dq = x.detach().double(), dequantize(q, scales, scaling, x.shape).double()
    qf, nz = q.float().abs(), x64 != 0
    n, fi = max(int(nz.sum()), 1), torch.finfo(q.dtype)
    err, norm = x64 - dq, float(torch.linalg.vector_norm(x64))
    over = (x64.abs() > fi.max) if scaling == "none" else torch.zeros_like(nz)
    return {"rel_error": float(torch.linalg.vector_norm(err)) / norm if norm else 0.0,
            "mean_rel_error": float((err.abs()[nz] / x64.abs()[nz]).mean()) if nz.any() else 0.0,
            "max_abs_error": float(err.abs().max()),
            "overflow": int((over & nz).sum()) / n,
            "underflow": int((nz & (dq == 0)).sum()) / n,
            "subnormal": int((nz & (qf > 0) & (qf < fi.smallest_normal)).sum()) / n}


def capture(seed=0, hidden=256, layers=2, vocab=1024, seq=64, batch=4, ffn=512,
            outlier_channels=(3, 77), outlier_scale=100.0) -> dict:
    """Real tensors of a small random Llama (transformers, no download), one forward+backward
    on random tokens: "activation" (input of the last layer's q_proj, with outlier channels),
    "weight" (that q_proj's weight), "activation_grad" (gradient of its output, what the
    backward matmuls take), "weight_grad" (its weight's gradient). Outliers as LLMs have them
    (a few hidden channels ~100x the rest, Dettmers et al. 2022): the last layer's input-norm
    weight is scaled by outlier_scale on outlier_channels."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=seq)
    model = LlamaForCausalLM(cfg)
    last = model.model.layers[-1]
    with torch.no_grad():
        last.input_layernorm.weight[list(outlier_channels)] *= outlier_scale
    proj, out = last.self_attn.q_proj, {}

    def hook(mod, inputs, output):
        out["activation"] = inputs[0].detach().reshape(-1, hidden).clone()
        output.register_hook(lambda g: out.__setitem__("activation_grad",
                                                       g.detach().reshape(-1, hidden).clone()))

    handle = proj.register_forward_hook(hook)
    tokens = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    model(input_ids=tokens, labels=tokens).loss.backward()
    handle.remove()
    return {"activation": out["activation"], "weight": proj.weight.detach().clone(),
            "activation_grad": out["activation_grad"], "weight_grad": proj.weight.grad.clone()}


def compare(tensors, dtypes=DTYPES, scalings=SCALINGS) -> list[dict]:
    """One row per tensor kind x dtype x scaling: `error_stats` of that case."""
    return [{"kind": kind, "dtype": d, "scaling": s, **error_stats(x, s, d)}
            for kind, x in tensors.items() for d in dtypes for s in scalings]


def table(rows) -> str:
    cols = ("kind", "dtype", "scaling", "rel_error", "mean_rel_error", "underflow", "overflow",
            "subnormal")
    lines = ["{:<16}{:<6}{:<14}{:>10}{:>15}{:>10}{:>10}{:>10}".format(*cols)]
    for r in rows:
        lines.append("{:<16}{:<6}{:<14}{:>10.4f}{:>15.4f}{:>10.2%}{:>10.2%}{:>10.2%}".format(
            *(r[c] for c in cols)))
    return "\n".join(lines)


def report(seed=0) -> list[dict]:
    """Print the comparison on `capture(seed)` as a table; return its rows."""
    print(table(rows := compare(capture(seed))))
    return rows


def memory_table(params="llama2-7b", optimizer="adamw", seq_len=4096, batch_size=1) -> dict:
    """What FP8 training saves, from labkit's own counts (`labkit.memory.state_bytes`,
    `labkit.activations.layer_terms`): {"states": rows of bytes per parameter (and GB for
    `params`, a preset name, ModelSpec or parameter count), "activations": rows of bytes one
    layer keeps for backward (only when `params` names a model)}. FP8 shrinks the 2-byte matmul
    copies to 1 byte; fp32 master weights and Adam moments stay, so 16 B/param becomes 14 at
    best, not 4. A 1-byte FP8 value: `labkit.precision.FORMATS["fp8-e4m3"].bits // 8`."""
    from labkit.activations import layer_terms
    from labkit.memory import state_bytes
    from labkit.models import get_model
    from labkit.precision import FORMATS as LAYOUTS
    one = LAYOUTS["fp8-e4m3"].bits // 8
    spec = None if isinstance(params, (int, float)) else get_model(params)
    n = spec.num_params() if spec else validate.positive("params", params)
    w, g, o = state_bytes("bf16-mixed", optimizer)
    cases = [("bf16-mixed", (w, g, o)),
             ("fp8-mixed (Transformer Engine: FP8 copies made per matmul)",
              state_bytes("fp8-mixed", optimizer)),
             ("FP8 weight copy kept instead of bf16", (one, g, o)),
             ("FP8 weights and FP8 gradients", (one, one, o))]
    states = [{"case": c, "weights": b[0], "grads": b[1], "optimizer (master + moments)": b[2],
               "bytes_per_param": sum(b), "GB": n * sum(b) / 1e9, "saving": (w + g + o) / sum(b)}
              for c, b in cases]
    if spec is None:
        return {"states": states, "activations": []}
    kw = dict(s=seq_len, b=batch_size, h=spec.hidden_size, a=spec.num_heads,
              kv=spec.num_kv_heads, q=spec.q_size, ffn=spec.ffn_size)
    bf16 = layer_terms("fused", "sdpa", value_bytes=2, **kw)
    low = layer_terms("fused", "sdpa", value_bytes=one, **kw)
    fp8 = dict(bf16)
    # The matmul inputs nothing else keeps: the norm outputs (inputs of QKV and gate/up) and
    # SwiGLU's product (input of down, 1 of its 3 tensors). The attention output stays 16-bit:
    # the attention backward needs it too.
    fp8["qkv and mlp inputs"] = low["qkv and mlp inputs"]
    key = "swiglu (gate, up, product)"
    fp8[key] = bf16[key] * 2 / 3 + low[key] / 3
    acts = [{"case": c, "bytes_per_layer": sum(t.values()), "saving": sum(bf16.values()) /
             sum(t.values())} for c, t in (("bf16", bf16), ("FP8 matmul inputs", fp8))]
    return {"states": states, "activations": acts}


class FP8Unavailable(RuntimeError):
    """torchao_linear_error needs a CUDA GPU and torchao; the message says which is missing."""


def torchao_linear_error(size=4096, tokens=4096, seed=0) -> dict:
    """Optional, on a GPU: one Linear converted by torchao's Float8Linear (dynamic per-tensor
    scaling) against the same layer in bf16, both against fp32: output relative errors."""
    import torch
    if not torch.cuda.is_available():
        raise FP8Unavailable("skipped: no CUDA GPU (FP8 matmuls need compute capability >= 8.9)")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise FP8Unavailable(f"skipped: torchao is not installed ({e}); labkit does not "
                             "depend on it") from None
    torch.manual_seed(seed)
    ref = torch.nn.Sequential(torch.nn.Linear(size, size, bias=False)).cuda()
    x = torch.randn(tokens, size, device="cuda")
    exact = ref(x)
    import copy          # Module.to and convert_to_float8_training change a module in place
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)(x.bfloat16()).float()
    f8 = convert_to_float8_training(copy.deepcopy(ref).to(torch.bfloat16))(x.bfloat16()).float()

    def rel(y):
        return float(torch.linalg.vector_norm(y - exact) / torch.linalg.vector_norm(exact))
    return {"bf16": rel(bf16), "float8": rel(f8)}
