"""Mixture of experts by hand: a top-k router with its load-balancing loss, the one-process MoE
(SwiGLU experts, GShard's capacity), and expert parallelism over `all_to_all_single`.

    moe = MoE(hidden=64, ffn=128, num_experts=8, k=2, capacity_factor=1.25)
    y = moe(x)                                  # x: (tokens, hidden); moe.last: MoEStats
    ep = ExpertParallelMoE.from_moe(moe, group) # this rank keeps num_experts / ep experts
    y_mine = ep(x_mine)                         # == moe(x)[my tokens], gradients too

How: `ExpertParallelMoE.forward`: tokens routed where they live, sent to their experts' ranks
sorted by expert (dispatch), computed expert-major (`permute_to_expert_major`), sent back
(combine); backward runs both exchanges in reverse (`_AllToAll`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit import validate

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """A router's decision for T tokens: `indices` (T, k) experts, `weights` (T, k) their
    combine weights, `probs` (T, E) the scores, `aux_loss` (a scalar), `tokens_per_expert` (E,)
    assignments per expert before any is dropped."""

    indices: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


class TopKRouter(nn.Module):
    """A linear gate over `num_experts`, top-k selection and the Switch / GShard auxiliary loss.

    score="softmax" (Switch, GShard, Mixtral, Qwen3-MoE): probabilities over all experts, the
    k largest kept; normalize=True rescales the k weights to sum to 1 (Mixtral, Qwen3's
    norm_topk_prob). score="sigmoid" (DeepSeek-V3): an independent score per expert, the k
    largest kept and normalised to sum to 1. Auxiliary loss (Fedus et al. 2021, eq. 4; Lepikhin
    et al. 2020): E x sum_e f_e P_e, f_e the share of the T k assignments that go to expert e,
    P_e the mean score of expert e: 1 when routing is uniform, up to E when one expert takes
    all (transformers' load_balancing_loss_func is k times this)."""

    def __init__(self, hidden: int, num_experts: int, k: int, score: str = "softmax",
                 normalize: bool = True):
        super().__init__()
        self.hidden = validate.positive_int("hidden", hidden, 2**20)
        self.num_experts = validate.positive_int("num_experts", num_experts, 2**16)
        self.k = validate.positive_int("k", k, self.num_experts)
        self.score = validate.choice("score", score, SCORES)
        self.normalize = validate.choice("normalize", normalize, (True, False))
        self.gate = nn.Linear(hidden, num_experts, bias=False)

    def forward(self, x: torch.Tensor, counts_over=None) -> Routing:
        """Route x (T, hidden). counts_over(local (E,) counts, local score sums (E,), T) ->
        (global counts, global T): how expert parallelism makes f_e and P_e the whole batch's
        (default: this x is the whole batch)."""
        logits = self.gate(x)
        probs = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        top, indices = probs.topk(self.k, dim=-1)
        weights = top / top.sum(-1, keepdim=True) if (self.normalize or self.score ==
                                                        "sigmoid") else top
        counts = torch.bincount(indices.flatten(), minlength=self.num_experts)
        total_counts, tokens = (counts, x.shape[0]) if counts_over is None else \
            counts_over(counts, x.shape[0])
        share = total_counts.to(probs.dtype) / (tokens * self.k)
        aux = self.num_experts * (share * probs.sum(0) / tokens).sum()
        return Routing(indices, weights, probs, aux, counts)


@dataclass
class MoEStats:
    """What the last forward did: assignments per expert (before dropping), the capacity per
    expert (None: no limit), assignments dropped over it, and the router's auxiliary loss."""

    tokens_per_expert: torch.Tensor
    capacity: int | None
    dropped: int
    aux_loss: torch.Tensor


def capacity(tokens: int, k: int, num_experts: int, capacity_factor) -> int | None:
    """GShard's expert capacity: ceil(capacity_factor x tokens x k / num_experts) assignments
    per expert per batch; None (no capacity_factor): no limit."""
    if capacity_factor is None:
        return None
    cf = validate.positive("capacity_factor", capacity_factor, 1e6)
    return math.ceil(cf * tokens * k / num_experts)


def slot_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(k, E): assignments of each slot (first choice, second, ...) to each expert."""
    return F.one_hot(indices.t(), num_experts).sum(1)


def kept_mask(indices: torch.Tensor, num_experts: int, cap, offset=None) -> torch.Tensor:
    """(T, k) bool: which assignments fit their expert's capacity `cap`. Priority as GShard:
    every token's first choice before any second choice, then token order. `offset` (k, E):
    assignments to each expert that come before this batch's slot-j ones (default: this batch's
    earlier slots, the whole batch being here)."""
    if cap is None:
        return torch.ones_like(indices, dtype=torch.bool)
    one_hot = F.one_hot(indices.t(), num_experts)                 # (k, T, E), slot-major
    if offset is None:
        per_slot = one_hot.sum(1)
        offset = per_slot.cumsum(0) - per_slot
    position = one_hot.cumsum(1) - one_hot + offset[:, None, :]   # 0-based within the expert
    return ((position * one_hot).sum(-1) < cap).t()               # (T, k)


def swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


class MoE(nn.Module):
    """The one-process reference: a router, `num_experts` SwiGLU experts (hidden -> ffn ->
    hidden, weights stacked (E, ...)), `shared_experts` SwiGLU experts every token also goes
    through (DeepSeek-V3), and GShard's capacity when `capacity_factor` is set: assignments over
    an expert's capacity are dropped (they add nothing; counted in `last.dropped`).

    forward(x (..., hidden)) -> y (same shape): sum over kept assignments of weight x expert(x),
    plus the shared experts. `last` (MoEStats) says what it did."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, k: int, capacity_factor=None,
                 shared_experts: int = 0, score: str = "softmax", normalize: bool = True):
        super().__init__()
        self.router = TopKRouter(hidden, num_experts, k, score, normalize)
        self.hidden, self.num_experts, self.k = hidden, num_experts, k
        self.ffn = validate.positive_int("ffn", ffn, 2**22)
        capacity(1, k, num_experts, capacity_factor)                 # validates it
        self.capacity_factor = capacity_factor
        if isinstance(shared_experts, bool) or not isinstance(shared_experts, int) \
                or not 0 <= shared_experts <= 64:
            raise ValueError(f"shared_experts={validate.describe(shared_experts)} must be a "
                             "whole number from 0 to 64")
        self.shared_experts = shared_experts
        scale = hidden ** -0.5
        self.w_gate = nn.Parameter(torch.randn(num_experts, hidden, ffn) * scale)
        self.w_up = nn.Parameter(torch.randn(num_experts, hidden, ffn) * scale)
        self.w_down = nn.Parameter(torch.randn(num_experts, ffn, hidden) * ffn ** -0.5)
        width = ffn * self.shared_experts
        self.shared = nn.ParameterList([
            nn.Parameter(torch.randn(hidden, width) * scale),
            nn.Parameter(torch.randn(hidden, width) * scale),
            nn.Parameter(torch.randn(width, hidden) * max(width, 1) ** -0.5)]) if width else None
        self.last: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        r = self.router(x)
        cap = capacity(x.shape[0], self.k, self.num_experts, self.capacity_factor)
        keep = kept_mask(r.indices, self.num_experts, cap)
        y = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = ((r.indices == e) & keep).nonzero(as_tuple=True)
            if len(token):
                out = swiglu(x[token], self.w_gate[e], self.w_up[e], self.w_down[e])
                y = y.index_add(0, token, out * r.weights[token, slot, None])
        if self.shared is not None:
            y = y + swiglu(x, *self.shared)
        self.last = MoEStats(r.tokens_per_expert, cap, int((~keep).sum()), r.aux_loss)
        return y.reshape(shape)


def permute_to_expert_major(tokens_per_expert_group, ep_size: int):
    """(indices, tokens_per_expert) for the tokens a rank received in a dispatch.

    They arrive rank-major: from rank 0 its tokens for this rank's expert 0, expert 1, ..., then
    from rank 1, ...; `tokens_per_expert_group` (1-D, length ep_size x experts per rank) counts
    them in that order; any count may be 0. `indices` reorders them expert-major (expert 0's
    tokens from rank 0, from rank 1, ..., then expert 1's ...): received[indices] is contiguous
    per expert, and `tokens_per_expert` (experts per rank,) sums over the source ranks."""
    counts = torch.as_tensor(tokens_per_expert_group)
    if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError("tokens_per_expert_group must be a 1-D tensor of whole counts; got "
                         f"{tuple(counts.shape)} {counts.dtype}")
    ep = validate.positive_int("ep_size", ep_size, validate.MAX_RANKS)
    if counts.numel() % ep:
        raise ValueError(f"tokens_per_expert_group has {counts.numel()} counts, not a multiple "
                         f"of ep_size={ep} (ep_size x experts per rank)")
    if (counts < 0).any():
        raise ValueError("tokens_per_expert_group has a negative count")
    grid = counts.view(ep, -1)                                   # (source rank, local expert)
    starts = (counts.cumsum(0) - counts).view(ep, -1)
    pieces = [torch.arange(int(starts[r, e]), int(starts[r, e] + grid[r, e]))
              for e in range(grid.shape[1]) for r in range(ep)]
    indices = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return indices.long(), grid.sum(0)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: backward sends the gradients back the way they came
    (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x, out_splits, in_splits, group=None):
    """all_to_all_single of the rows of x (autograd: the reverse exchange in backward)."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class ExpertParallelMoE(nn.Module):
    """Expert parallelism over a process group of ep ranks: rank r keeps experts
    [r E/ep, (r+1) E/ep); the router and the shared experts are replicated. On the same tokens
    (this rank's share of the batch, the ranks' shares in rank order) outputs equal the
    one-process MoE's; the experts' gradients are the MoE's for the experts this rank keeps,
    the router's and the shared experts' sum over the ranks to the MoE's (all-reduce them with
    the data-parallel gradients). Capacity and the auxiliary loss are the whole batch's, as in
    the MoE: each rank learns the others' counts (an all_gather of (k, E) integers)."""

    def __init__(self):
        super().__init__()

    @classmethod
    def from_moe(cls, moe: MoE, group=None) -> "ExpertParallelMoE":
        import torch.distributed as dist

        from labkit.parallel import require_process_group

        require_process_group("ExpertParallelMoE.from_moe")
        self = cls()
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        E = moe.num_experts
        if E % self.ep:
            raise ValueError(f"num_experts={E} does not split over ep={self.ep} ranks; allowed "
                             f"ep: a divisor of {E}")
        self.num_experts, self.k, self.hidden = E, moe.k, moe.hidden
        self.local = E // self.ep
        self.capacity_factor = moe.capacity_factor
        self.router = copy.deepcopy(moe.router)          # replicated: same weights, dtype
        mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
        self.w_gate = nn.Parameter(moe.w_gate.detach()[mine].clone())
        self.w_up = nn.Parameter(moe.w_up.detach()[mine].clone())
        self.w_down = nn.Parameter(moe.w_down.detach()[mine].clone())
        self.shared = (nn.ParameterList([nn.Parameter(p.detach().clone()) for p in moe.shared])
                       if moe.shared is not None else None)
        self.last: MoEStats | None = None
        return self

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return torch.stack(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        shape = x.shape
        x = x.reshape(-1, self.hidden)
        E, k, T = self.num_experts, self.k, x.shape[0]
        batch = {}

        def whole_batch(counts, tokens):                 # f_e and P_e over every rank's tokens
            every = self._gather(torch.cat([counts, counts.new_tensor([tokens])]))
            batch["tokens"] = int(every[:, E].sum())
            return every[:, :E].sum(0), batch["tokens"]

        r = self.router(x, counts_over=whole_batch)
        cap = capacity(batch["tokens"], k, E, self.capacity_factor)
        offset = None
        if cap is not None:                              # the one-process MoE's priority order
            per_slot = self._gather(slot_counts(r.indices, E))            # (ep, k, E)
            everyone = per_slot.sum(0)
            offset = (everyone.cumsum(0) - everyone) + per_slot[:self.rank].sum(0)
        keep = kept_mask(r.indices, E, cap, offset)
        # dispatch: kept assignments sorted by expert (so by the rank that holds it)
        token, slot = keep.nonzero(as_tuple=True)
        expert = r.indices[token, slot]
        order = torch.argsort(expert * T * k + token * k + slot)
        token, slot, expert = token[order], slot[order], expert[order]
        counts = torch.bincount(expert, minlength=E)                     # (E,) to send
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)       # (ep x local,)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = received.view(self.ep, self.local).sum(1).tolist()
        tokens_in = all_to_all(x[token], recv, send, self.group)
        idx, per_expert = permute_to_expert_major(received, self.ep)
        grouped = tokens_in[idx]
        outs, start = [], 0
        for e, n in enumerate(per_expert.tolist()):
            outs.append(swiglu(grouped[start:start + n], self.w_gate[e], self.w_up[e],
                               self.w_down[e]))
            start += n
        done = torch.cat(outs) if outs else grouped
        back = torch.empty_like(done).index_copy(0, idx, done) if len(idx) else done
        results = all_to_all(back, send, recv, self.group)               # combine
        y = torch.zeros_like(x).index_add(0, token, results * r.weights[token, slot, None])
        if self.shared is not None:
            y = y + swiglu(x, *self.shared)
        self.last = MoEStats(r.tokens_per_expert, cap, int((~keep).sum()), r.aux_loss)
        return y.reshape(shape)
