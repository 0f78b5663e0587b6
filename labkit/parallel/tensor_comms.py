"""Tensor parallelism's collectives as autograd Functions (Megatron-LM, Shoeybi et al. 2019, §3).

    x = f.apply(x, group)          # before a column-parallel layer: all-reduce in the backward
    y = g.apply(y, group)          # after a row-parallel layer: all-reduce in the forward

A collective inside a model must say what happens to the gradient on the way back, so each one
is a `torch.autograd.Function` with a forward and its conjugate backward: the table of all
seven is above `f`, the sequence layout above `sp_gather`. Every Function takes `group` (None:
the default group) and works on any tp, tp = 1 included (then each is the identity).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit import validate


def tp_size(group=None) -> int:
    return dist.get_world_size(group)


def tp_rank(group=None) -> int:
    return dist.get_rank(group)


def _check_divides(x, dim: int, group, what: str) -> int:
    tp = tp_size(group)
    validate.divides("tp", tp, what, x.shape[dim])
    return tp


# Written with the raw `torch.distributed` ops (no autograd of their own), so each Function
# below is the whole story of the gradient. `dist.all_gather` used *without* such a Function is
# the classic bug: its outputs are not in the autograd graph
# (tensor.NoAutogradColumnParallelLinear shows it).
def _all_reduce(x, group):
    out = x.clone()          # a copy: x may be saved by autograd for another op's backward
    if tp_size(group) > 1:   # one rank: the sum is the tensor itself, nothing to send
        dist.all_reduce(out, group=group)
    return out


# torch 2.13 names them *_single and deprecates *_into_tensor / *_tensor; older torch has only those
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_dim0(x, group):
    """[n, ...] on each rank -> [tp*n, ...], rank r's block at rows [r*n, (r+1)*n)."""
    tp = tp_size(group)
    if tp == 1:
        return x
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(x, group):
    """[tp*n, ...] on each rank -> [n, ...]: the sum over ranks of rank r's block of rows."""
    tp = _check_divides(x, 0, group, "the sequence length (dim 0) s")
    if tp == 1:
        return x
    out = torch.empty((x.shape[0] // tp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _all_gather_last(x, group):
    """[..., n] -> [..., tp*n]: the last dim moved first, gathered, moved back."""
    tp = tp_size(group)
    if tp == 1:
        return x
    blocks = _all_gather_dim0(x.movedim(-1, 0), group)          # [tp*n, ...], rank r's at r*n
    return blocks.movedim(0, -1).contiguous()


def _split(x, dim: int, group, what: str):
    """This rank's contiguous 1/tp of dim `dim`."""
    tp = _check_divides(x, dim, group, what)
    return x.chunk(tp, dim=dim)[tp_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------
# The Functions of this module, each forward with its conjugate backward:
#
# | Function            | forward                             | backward                      |
# |---------------------|-------------------------------------|-------------------------------|
# | `f`                 | identity                            | all-reduce (sum)              |
# | `g`                 | all-reduce (sum)                    | identity                      |
# | `gather`            | all-gather along the last dim       | keep this rank's slice        |
# | `scatter`           | keep this rank's slice (last dim)   | all-gather along the last dim |
# | `sp_gather`         | all-gather along the sequence dim   | reduce-scatter (sequence dim) |
# | `sp_reduce_scatter` | reduce-scatter along the sequence   | all-gather (sequence dim)     |
# | `sp_split`          | keep this rank's sequence slice     | all-gather (sequence dim)     |
#
# Megatron's conjugate pair


class f(torch.autograd.Function):
    """Identity forward, all-reduce backward: put before a column-parallel layer.

    Forward: every rank already holds the whole input X, so nothing moves. Backward: rank r's
    layer only sees its columns A_r, so it computes dL/dX through A_r alone, a partial sum;
    the true dL/dX = sum_r dL/dY_r A_r^T needs the all-reduce.
    """

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class g(torch.autograd.Function):
    """All-reduce forward, identity backward: put after a row-parallel layer.

    Forward: rank r computes X_r B_r, one term of Y = sum_r X_r B_r; the all-reduce sums them.
    Backward: dL/dY is the same on every rank (Y is), and dY/d(X_r B_r) is the identity, so
    each rank passes its gradient through as it is.
    """

    @staticmethod
    def forward(ctx, x, group=None):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------------------------------------
# gather / scatter along the last (hidden) dim: gather_output=True, input_is_parallel=False


class gather(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's slice backward.

    Forward: each rank holds its slice of the features; all-gather makes the full output.
    Backward: the full output's gradient is on every rank; this rank's slice only concerns the
    features it produced, so it keeps that slice (no communication).
    """

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group, "the gradient's last dim"), None


class scatter(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward, all-gather backward.

    Forward: the full input is on every rank; a row-parallel layer needs only its slice.
    Backward: each rank has the gradient of its slice; the full input's gradient is all of them.
    """

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _split(x, -1, group, "the input's last dim (in_features)")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group), None


# ---------------------------------------------------------------------------------------------
# sequence parallelism (Korthikanti et al. 2022): along the sequence dim 0 of [s, b, h]
# (sequence, batch, hidden), Megatron's layout, so a sequence shard is a contiguous block of
# whole rows: rank r of tp holds positions [r*s/tp, (r+1)*s/tp).


class sp_gather(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (Korthikanti's g).

    Forward: LayerNorm ran on this rank's sequence shard; the column layer needs the whole
    sequence. Backward: each rank's column layer gives a partial gradient for the *whole*
    sequence (through its columns only); summing over ranks and keeping this rank's shard is
    exactly a reduce-scatter, half the traffic of f's all-reduce.
    """

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class sp_reduce_scatter(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (Korthikanti's g-bar).

    Forward: the row layer's partial sums (whole sequence) are summed and each rank keeps its
    sequence shard, for the dropout, residual and LayerNorm that follow. Backward: the shard's
    gradient from each rank is gathered into the whole sequence's gradient, the same on all.
    """

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class sp_split(torch.autograd.Function):
    """Keep this rank's sequence shard forward, all-gather backward: entering the sequence-
    parallel region from a tensor every rank holds whole (e.g. the input of the first block)."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _split(x, 0, group, "the sequence length (dim 0) s")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None
