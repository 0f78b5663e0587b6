"""Module 05's exercise model, reused by module 08's: a two-block debug Llama (`SPEC`, `build`),
its batches and one plain step, and the comparisons of full parameters.
"""
from __future__ import annotations

import torch

from labkit.models import get_model

SEED, LR, SGD_LR, ROWS, SEQ = 1234, 1e-2, 0.5, 2, 16


SPEC = get_model("debug-llama").with_(name="fsdp-exercise", num_layers=2, hidden_size=64,
                                      num_heads=4, num_kv_heads=2, ffn_size=128, vocab_size=256,
                                      max_seq_len=64)


def build(seed: int):
    """The exercise's Llama with weights from `seed` (fp32, SDPA attention)."""
    from labkit.labs.common.models import build_model

    torch.manual_seed(seed)
    return build_model(SPEC, None, torch.float32, "sdpa")


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    return torch.randint(0, SPEC.vocab_size, (rows, SEQ), generator=g)


def plain_step(model, opt, tokens) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    return float(loss)


def full_params(model) -> dict:
    """Every parameter whole (DTensors gathered), in fp32, by name."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def max_diff(got: dict, want: dict) -> float:
    return max(float((got[k] - w).abs().max()) / max(float(w.abs().max()), 1e-12)
               for k, w in want.items())
