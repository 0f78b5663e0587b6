"""A transformer block split Megatron's way, beside the single-device block it is built from.

    block = Block(h, heads)                                         # the reference, [s, b, h]
    par = ParallelBlock.from_block(block, sequence_parallel=True)   # this rank's shards
    mlp = ParallelMLP.from_mlp(MLP(h))          # or ParallelAttention.from_attention(attn)

Activations are [s, b, h] (sequence, batch, hidden), Megatron's layout (Shoeybi et al. 2019,
§3). What each class computes and sends: its docstring.
"""
from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import nn

from labkit import validate
from labkit.parallel.tensor_comms import tp_size
from labkit.parallel.tensor_linear import ColumnParallelLinear, RowParallelLinear, check_flag


class MLP(nn.Module):
    """The reference MLP: fc1 (h -> ffn), GeLU, fc2 (ffn -> h)."""

    def __init__(self, hidden_size: int, ffn_size: int | None = None, bias: bool = True):
        super().__init__()
        ffn_size = 4 * hidden_size if ffn_size is None else ffn_size
        self.fc1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def attend(qkv, heads: int):
    """[s, b, heads*3*d] in the by-head layout -> causal attention -> [s, b, heads*d]."""
    s, b, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.view(s, b, heads, 3, d).permute(3, 1, 2, 0, 4)     # each [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # [b, heads, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class SelfAttention(nn.Module):
    """The reference attention: causal multi-head attention with one fused `qkv` Linear
    (h -> 3h) whose output features are grouped *by head* (Megatron's layout): head i's q, k, v
    are rows [3*d*i, 3*d*(i+1)) of qkv.weight, d = h / heads. A contiguous 1/tp of those rows
    is then a set of whole heads, so the column split of `ParallelAttention` is a split by
    heads."""

    def __init__(self, hidden_size: int, num_heads: int, bias: bool = True):
        super().__init__()
        validate.divides("num_heads", num_heads, "hidden_size", hidden_size)
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)   # by-head layout
        self.proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.proj(attend(self.qkv(x), self.num_heads))


class Block(nn.Module):
    """The reference block: pre-LayerNorm, x + attn(ln1(x)), then x + mlp(ln2(x)); no dropout
    (it would run on whatever each rank holds, with a per-rank seed under sequence
    parallelism)."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_size: int | None = None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden_size), nn.LayerNorm(hidden_size)
        self.attn = SelfAttention(hidden_size, num_heads)
        self.mlp = MLP(hidden_size, ffn_size)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _check(cls: str, what: str, module, kind, parts=()):
    """`module` is a `kind`, or (parts given) has nn.Linear attributes named `parts`."""
    duck = bool(parts) and all(isinstance(getattr(module, p, None), nn.Linear) for p in parts)
    if not (isinstance(module, kind) or duck):
        also = f", or a module with nn.Linear attributes {', '.join(parts)}" if parts else ""
        raise ValueError(f"{cls}: {what}={validate.describe(module)} is not a {kind.__name__}; "
                         f"allowed: a labkit.parallel.tensor.{kind.__name__}{also}")


class ParallelMLP(nn.Module):
    """fc1 column-parallel (ffn/tp features per rank), GeLU, fc2 row-parallel: one all-reduce
    in the forward (g after fc2) and one in the backward (f before fc1). `from_mlp` copies this
    rank's shards."""

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def from_mlp(cls, mlp, group=None, sequence_parallel=False):
        _check(cls.__name__, "mlp", mlp, MLP, ("fc1", "fc2"))
        return cls(ColumnParallelLinear.from_linear(mlp.fc1, group=group,
                                                    sequence_parallel=sequence_parallel),
                   RowParallelLinear.from_linear(mlp.fc2, group=group,
                                                 sequence_parallel=sequence_parallel))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))     # GeLU is element-wise: no communication


class ParallelAttention(nn.Module):
    """qkv column-parallel by heads (num_heads/tp whole heads per rank, attention computed on
    them alone), proj row-parallel: again one all-reduce each way. `from_attention` copies this
    rank's shards."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, num_heads: int):
        super().__init__()
        validate.divides("tp", qkv.tp, "num_heads", num_heads)
        self.qkv, self.proj = qkv, proj
        self.num_heads, self.local_heads = num_heads, num_heads // qkv.tp

    @classmethod
    def from_attention(cls, attn, group=None, sequence_parallel=False):
        _check(cls.__name__, "attn", attn, SelfAttention, ("qkv", "proj"))
        heads = validate.positive_int("attn.num_heads", getattr(attn, "num_heads", None))
        validate.divides("tp", tp_size(group), "num_heads", heads)   # before any copy
        return cls(ColumnParallelLinear.from_linear(attn.qkv, group=group,
                                                    sequence_parallel=sequence_parallel),
                   RowParallelLinear.from_linear(attn.proj, group=group,
                                                 sequence_parallel=sequence_parallel), heads)

    def forward(self, x):
        return self.proj(attend(self.qkv(x), self.local_heads))   # this rank's heads only


class ParallelBlock(nn.Module):
    """ParallelAttention and ParallelMLP, with the LayerNorms replicated (`from_block`).
    sequence_parallel=True: the block's input and output are this rank's sequence shard
    [s/tp, b, h], the LayerNorms and residual adds run on the shard, and each all-reduce becomes
    an all-gather (before the column layer) plus a reduce-scatter (after the row layer); call
    `tensor_linear.sync_sequence_parallel_grads(block)` after backward."""

    def __init__(self, ln1, attn: ParallelAttention, ln2, mlp: ParallelMLP,
                 sequence_parallel=False):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.sequence_parallel = check_flag("sequence_parallel", sequence_parallel)
        if sequence_parallel:
            for ln in (ln1, ln2):                 # they see one sequence shard: partial grads
                for p in ln.parameters():
                    p.sequence_parallel = True

    @classmethod
    def from_block(cls, block, group=None, sequence_parallel=False):
        _check(cls.__name__, "block", block, Block)
        return cls(copy.deepcopy(block.ln1),
                   ParallelAttention.from_attention(block.attn, group, sequence_parallel),
                   copy.deepcopy(block.ln2),
                   ParallelMLP.from_mlp(block.mlp, group, sequence_parallel), sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
