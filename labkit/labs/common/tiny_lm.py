"""Module 03's exercise model, reused by module 04's: `TinyLM`, a next-token model with every case
a DDP must handle (tied weights, an unused parameter, a buffer), and its batches.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

SEED, LR, ROWS, SEQ = 1234, 0.5, 4, 8     # rows: sequences per rank (per micro-batch) per step


class TinyLM(nn.Module):
    """A next-token model with every case a DDP must handle; `model(tokens, targets)` -> loss."""

    def __init__(self, vocab: int = 64, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.frozen = nn.Linear(hidden, hidden).requires_grad_(False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight            # tied: one Parameter, used twice
        self.register_buffer("scale", torch.rand(hidden) + 0.5)

    def forward(self, tokens, targets=None):
        x = self.embed(tokens) * self.scale
        x = x + torch.tanh(self.mix(x)) + 0.1 * self.frozen(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_lm(seed: int, device="cpu") -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(device)


def lm_batch(step: int, rows: int, vocab: int, device):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    tokens = torch.randint(0, vocab, (rows, SEQ + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]
