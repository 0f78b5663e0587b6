"""The vocabulary split over tp ranks: Megatron's embedding and cross-entropy (Shoeybi et al. §3).

    emb = VocabParallelEmbedding(full_table, group=tp_group)    # ids [s, b] -> [s, b, h]
    loss = vocab_parallel_cross_entropy(logits_shard, target).mean()   # logits [s, b, V/tp]

Rank r owns tokens [r*V/tp, (r+1)*V/tp): rows of the embedding table, and of the output layer
(a column-parallel Linear h -> V, whose logits stay split: gathering b*s*V logits would be the
largest tensor of the step). What each sends: its docstring.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import validate
from labkit.parallel import require_process_group
from labkit.parallel.tensor_comms import g, sp_reduce_scatter, tp_rank, tp_size
from labkit.parallel.tensor_linear import check_flag


class VocabParallelEmbedding(nn.Module):
    """weight: rows [r*V/tp, (r+1)*V/tp) of the full [V, h] table.

    Each rank looks up the tokens it owns, writes zeros for the others, and an all-reduce (g)
    sums the ranks' rows: exactly one rank contributed each token's row. With
    sequence_parallel=True a reduce-scatter along the sequence instead, leaving this rank's
    shard [s/tp, b, h] for the first block. Ids are [s, b]."""

    def __init__(self, weight, *, group=None, sequence_parallel=False):
        super().__init__()
        require_process_group(type(self).__name__)
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and
                weight.is_floating_point()):
            raise ValueError(f"VocabParallelEmbedding: weight={validate.describe(weight)} is "
                             "not a table; allowed: a 2-D floating-point tensor [vocab, hidden]")
        self.group, self.sequence_parallel = group, check_flag("sequence_parallel",
                                                               sequence_parallel)
        self.tp, self.rank = tp_size(group), tp_rank(group)
        self.num_embeddings, self.embedding_dim = weight.shape
        validate.divides("tp", self.tp, "the vocabulary num_embeddings", self.num_embeddings)
        self.per_rank = self.num_embeddings // self.tp
        self.start = self.rank * self.per_rank
        self.weight = nn.Parameter(weight.detach()[self.start:self.start + self.per_rank].clone())

    @classmethod
    def from_embedding(cls, embedding, group=None, sequence_parallel=False):
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"VocabParallelEmbedding.from_embedding: embedding="
                             f"{validate.describe(embedding)} is not an nn.Embedding; allowed: a "
                             "torch.nn.Embedding holding the full table")
        return cls(embedding.weight, group=group, sequence_parallel=sequence_parallel)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)      # any valid row; zeroed below
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return sp_reduce_scatter.apply(rows, self.group)    # sum + keep the sequence shard
        return g.apply(rows, self.group)                        # sum: each row from its owner

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, "
                f"tokens [{self.start}, {self.start + self.per_rank})")


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group):
        per_rank = logits.shape[-1]
        start = tp_rank(group) * per_rank
        # 1. the global max over the vocabulary, for a stable exp (a constant: no gradient)
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        z = logits - top.unsqueeze(-1)
        # 2. the target's logit: only the rank owning the token has it, the others add 0
        outside = (target < start) | (target >= start + per_rank)
        local = (target - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        # 3. the sum of exponentials over the whole vocabulary
        exp = z.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)   # softmax slice
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        # d loss / d logits = softmax - onehot(target): each rank's slice, no communication
        softmax, local, outside = ctx.saved_tensors
        onehot = F.one_hot(local, softmax.shape[-1]).to(softmax.dtype)
        onehot.masked_fill_(outside.unsqueeze(-1), 0.0)
        return (softmax - onehot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits_shard, target, group=None):
    """Cross-entropy per token (no reduction: `.mean()` it) from this rank's vocabulary slice of
    the logits [..., V/tp], with target [...] holding token ids in [0, V).

    The logits are never gathered. log-sum-exp over all V needs the global max (one all-reduce
    MAX of b*s numbers), the target's logit (all-reduce SUM: only its owner has it) and the sum
    of exponentials (all-reduce SUM): 3 small all-reduces forward, none backward, where each
    rank's gradient softmax - onehot is already its own slice. Logits [s, b, V/tp] (any
    leading shape works)."""
    require_process_group("vocab_parallel_cross_entropy")
    if not (isinstance(logits_shard, torch.Tensor) and logits_shard.is_floating_point() and
            logits_shard.dim() >= 1):
        raise ValueError(f"logits_shard={validate.describe(logits_shard)}; allowed: a floating-"
                         "point tensor [..., vocab/tp], this rank's slice of the logits")
    if not (isinstance(target, torch.Tensor) and not target.is_floating_point() and
            target.shape == logits_shard.shape[:-1]):
        raise ValueError(f"target={validate.describe(target)} does not fit logits_shard "
                         f"{tuple(logits_shard.shape)}; allowed: integer token ids of shape "
                         f"{tuple(logits_shard.shape[:-1])}")
    vocab = logits_shard.shape[-1] * tp_size(group)
    if target.numel() and (target.min() < 0 or target.max() >= vocab):
        raise ValueError(f"target holds ids from {target.min().item()} to {target.max().item()}; "
                         f"allowed: 0 to {vocab - 1} (vocab {vocab} = {logits_shard.shape[-1]} "
                         f"per rank x tp={tp_size(group)})")
    return _VocabParallelCrossEntropy.apply(logits_shard, target.long(), group)
