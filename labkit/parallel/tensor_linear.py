"""Megatron's column- and row-parallel linear layers (Shoeybi et al. 2019, §3), and the broken one.

    fc1 = ColumnParallelLinear.from_linear(nn.Linear(h, 4 * h))     # Y_r = f(X) A_r
    fc2 = RowParallelLinear.from_linear(nn.Linear(4 * h, h))        # Y = g(X_r A_r) + b
    y = fc2(F.gelu(fc1(x)))      # every rank passes the same full weights (same seed, or loaded)

Y = X A with A [in, out] (nn.Linear stores A^T, `weight` [out, in]); how each splits A and where
the bias goes: above `_ParallelLinear`. Sequence parallel (Korthikanti et al. 2022):
`sync_sequence_parallel_grads`. The pitfall: `NoAutogradColumnParallelLinear`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import validate
from labkit.parallel import require_process_group
from labkit.parallel.tensor_comms import (f, g, gather, scatter, sp_gather, sp_reduce_scatter,
                                          tp_rank, tp_size)


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={validate.describe(value)} is not a flag; allowed: True or False")
    return value


def _check_weight(cls: str, weight, bias):
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point()):
        raise ValueError(f"{cls}: weight={validate.describe(weight)} is not a weight; allowed: a "
                         "2-D floating-point tensor [out_features, in_features] (nn.Linear's)")
    if bias is not None and not (isinstance(bias, torch.Tensor) and
                                 tuple(bias.shape) == (weight.shape[0],)):
        raise ValueError(f"{cls}: bias={validate.describe(bias)} does not fit weight "
                         f"{tuple(weight.shape)}; allowed: None or a tensor of shape "
                         f"({weight.shape[0]},)")


def _shard(t, dim: int, tp: int, rank: int) -> nn.Parameter:
    """This rank's contiguous 1/tp of `t` along `dim`, a fresh Parameter (a copy, not a view)."""
    return nn.Parameter(t.detach().chunk(tp, dim=dim)[rank].clone())


# Y = X A with A [in, out] (nn.Linear stores A^T, `weight` [out, in]). Over tp ranks:
# - column-parallel: A = [A_1 ... A_tp] split by output features; rank r holds rows
#   [r*out/tp, (r+1)*out/tp) of `weight` and computes Y_r = X A_r, its slice of Y. X must be
#   whole on every rank (f: identity forward, all-reduce backward).
# - row-parallel: A split by input features; rank r holds columns [r*in/tp, (r+1)*in/tp) of
#   `weight`, takes X_r (its slice of X, which is exactly what a column layer left it) and
#   computes X_r A_r, one term of Y = sum_r X_r A_r (g: all-reduce forward, identity backward).
# Column then row needs no communication in between: the MLP's GeLU is element-wise and acts on
# each rank's slice alone. Biases: the column bias is split with its outputs; the row bias is
# whole on every rank and added once, after the reduction (adding it before would add it tp
# times).
class _ParallelLinear(nn.Module):
    split_dim = 0                    # 0: output features (column), 1: input features (row)
    split_name = "out_features"

    def __init__(self, weight, bias, group, sequence_parallel):
        super().__init__()
        cls = type(self).__name__
        require_process_group(cls)
        _check_weight(cls, weight, bias)
        self.sequence_parallel = check_flag("sequence_parallel", sequence_parallel)
        self.group = group
        self.tp, self.rank = tp_size(group), tp_rank(group)
        self.out_features, self.in_features = weight.shape
        full = weight.shape[self.split_dim]
        validate.divides("tp", self.tp, f"{cls}'s {self.split_name}", full)
        self.weight = _shard(weight, self.split_dim, self.tp, self.rank)

    @classmethod
    def _from(cls, linear, **options):
        """This rank's shard of an existing nn.Linear (every rank passes the same one)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{cls.__name__}.from_linear: linear={validate.describe(linear)} is "
                             "not an nn.Linear; allowed: a torch.nn.Linear holding the full "
                             "weights")
        return cls(linear.weight, linear.bias, **options)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={self.tp}, rank={self.rank}, weight shard={tuple(self.weight.shape)}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """Y_r = f(X) A_r + b_r: this rank's slice of the output features.

    weight: rows [r*out/tp, (r+1)*out/tp) of the full [out, in] weight; bias: the same slice.
    gather_output=True all-gathers Y (`gather`) so every rank holds it whole (e.g. the last
    layer); Megatron leaves it False before a row-parallel layer. sequence_parallel=True: the
    input is this rank's sequence shard [s/tp, b, in], all-gathered first (`sp_gather`).
    """

    def __init__(self, weight, bias=None, *, gather_output=False, group=None,
                 sequence_parallel=False):
        super().__init__(weight, bias, group, sequence_parallel)
        self.gather_output = check_flag("gather_output", gather_output)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True with sequence_parallel=True "
                             "is not supported (as in Megatron-LM); allowed: one of them")
        self.bias = None if bias is None else _shard(bias, 0, self.tp, self.rank)

    @classmethod
    def from_linear(cls, linear, gather_output=False, group=None, sequence_parallel=False):
        return cls._from(linear, gather_output=gather_output, group=group,
                         sequence_parallel=sequence_parallel)

    def forward(self, x):
        if self.sequence_parallel:
            x = sp_gather.apply(x, self.group)     # [s/tp, b, h] -> [s, b, h]
        else:
            x = f.apply(x, self.group)             # backward: sum the ranks' input gradients
        y = F.linear(x, self.weight, self.bias)    # [..., out/tp]: no communication
        return gather.apply(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Y = g(X_r A_r) + b: partial products summed over ranks, the whole bias added once.

    weight: columns [r*in/tp, (r+1)*in/tp) of the full [out, in] weight; bias: whole. With
    input_is_parallel=True (Megatron's default) the input is already this rank's slice of the
    features (a column layer's output); False: the full input, of which `scatter` keeps the
    slice. sequence_parallel=True: the sum is reduce-scattered along the sequence, leaving
    [s/tp, b, out] (and the bias, added on the shard, is marked sequence_parallel).
    """
    split_dim = 1
    split_name = "in_features"

    def __init__(self, weight, bias=None, *, input_is_parallel=True, group=None,
                 sequence_parallel=False):
        super().__init__(weight, bias, group, sequence_parallel)
        self.input_is_parallel = check_flag("input_is_parallel", input_is_parallel)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs "
                             "input_is_parallel=True (as in Megatron-LM); allowed: "
                             "input_is_parallel=True, or sequence_parallel=False")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    @classmethod
    def from_linear(cls, linear, input_is_parallel=True, group=None, sequence_parallel=False):
        return cls._from(linear, input_is_parallel=input_is_parallel, group=group,
                         sequence_parallel=sequence_parallel)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter.apply(x, self.group)       # keep this rank's slice of the features
        y = F.linear(x, self.weight)               # X_r A_r: one term of the sum
        if self.sequence_parallel:
            y = sp_reduce_scatter.apply(y, self.group)   # sum, keep this rank's sequence shard
        else:
            y = g.apply(y, self.group)             # sum over ranks: the one forward all-reduce
        return y if self.bias is None else y + self.bias


class NoAutogradColumnParallelLinear(ColumnParallelLinear):
    """BROKEN ON PURPOSE, for the pitfall: a column layer gathered with a bare `dist.all_gather`.

    The output is right, and so is this rank's weight gradient; the input gradient is silently
    wrong. `dist.all_gather` is not an autograd op: the other ranks' slices arrive as plain
    tensors, so the backward only flows through this rank's slice, and nothing (no f) sums the
    ranks' contributions to dL/dX. Each rank's x.grad is its own term X-grad_r = dL/dY_r A_r^T;
    the true gradient is their sum, so every layer below trains on a fraction of its gradient.
    Fix: `gather` / `f` above, torch.distributed.nn.functional.all_gather, or DTensor.
    """

    def __init__(self, weight, bias=None, *, group=None):
        super().__init__(weight, bias, gather_output=True, group=group)

    @classmethod
    def from_linear(cls, linear, group=None):
        return cls._from(linear, group=group)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)                 # no f: nothing sums dL/dX
        parts = [torch.empty_like(y) for _ in range(self.tp)]
        dist.all_gather(parts, y.contiguous(), group=self.group)   # outside the graph
        parts[self.rank] = y                                    # only this slice keeps its grad_fn
        return torch.cat(parts, dim=-1)


def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """All-reduce (sum) the gradients of `module`'s parameters marked `sequence_parallel` (the
    LayerNorms and row biases that saw only this rank's sequence shard): one all-reduce of them
    all, flattened, per step, after backward. Returns how many parameters it reduced.

    Sequence parallel (Korthikanti et al. 2022): the activations outside the column..row pair
    are sharded along the sequence (dim 0 of [s, b, h]); the column layer all-gathers the
    sequence (`sp_gather`) instead of f, the row layer reduce-scatters it (`sp_reduce_scatter`)
    instead of g. A parameter that then sees only this rank's sequence shard (the row bias, the
    LayerNorms) gets a partial gradient: it is marked `param.sequence_parallel = True` and this
    all-reduces those gradients once per step, as Megatron does."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={validate.describe(module)} is not a torch.nn.Module")
    params = [p for p in module.parameters()
              if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if params:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p.grad))
    return len(params)
