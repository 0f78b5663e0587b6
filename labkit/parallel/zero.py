"""ZeRO by hand (Rajbhandari et al. 2020): each rank keeps 1/N of the model states, not all.

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)       # ZeRO-1
    ddp_model(x).loss.backward(); ddp.finish_gradient_synchronization(); opt.step()
    opt = ShardedGradientOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)  # ZeRO-2
    model(x).loss.backward(); opt.step()            # no DDP: backward reduce-scatters
    model = FullyShardedModel(module)                # ZeRO-3, from labkit.parallel.zero3

The flat, padded layout (DeepSpeed's ZeRO-1/2, FSDP's flat parameters) and the rules:
`ShardedOptimizer`. What each stage holds and sends: docs/labkit.md.
"""
from __future__ import annotations

import numbers
import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

# padded_size and require_process_group live in the package, which zero3 (imported below for
# its re-export) also uses: zero3 never imports this module.
from labkit.parallel import padded_size, require_process_group
from labkit.parallel.zero3 import FullyShardedModel
from labkit.validate import MAX_RANKS, describe, positive_int

# ---------------------------------------------------------------------------------------------
# partitions (pure functions: the lesson and the exercises use them)


def partition_parameters(sizes, world_size) -> list[list[int]]:
    """Whole tensors to ranks, balanced by bytes, as torch's ZeroRedundancyOptimizer does: the
    largest first, each to the rank holding the fewest bytes so far (the lowest rank on a tie).
    Returns, per rank, the indices into `sizes` it owns, in increasing order.

        partition_parameters([400, 100, 300, 200], 2)   # -> [[0, 1], [2, 3]]: 500 B each
    """
    n = positive_int("world_size", world_size, MAX_RANKS)
    sizes = list(sizes)
    for i, size in enumerate(sizes):
        if not (isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 0):
            raise ValueError(f"sizes[{i}]={describe(size)} is not a size; allowed: whole numbers "
                             "of bytes >= 0 (one per parameter tensor)")
    loads, owned = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):    # stable: ties keep order
        rank = loads.index(min(loads))
        owned[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(o) for o in owned]


def check_optimizer_class(name: str, optimizer_class) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ValueError(f"optimizer_class={describe(optimizer_class)} is not an optimizer class; "
                         f"allowed: a subclass of torch.optim.Optimizer (e.g. torch.optim.AdamW, "
                         f"the class, not an instance), which {name} builds for this rank's shard")


# ---------------------------------------------------------------------------------------------
# ZeRO-1: optimizer states sharded


class ShardedOptimizer:
    """ZeRO-1: this rank keeps optimizer state for its 1/N shard of the flat parameters only.

    step(): this rank's slice of the gradients (already averaged, after DDP, or identical on
    every rank) -> the local optimizer updates the shard -> one all-gather gives every rank the
    full, identical parameters. With reduce_gradients=True the gradients are each rank's own
    and step() reduce-scatters them first (sum / N), as DeepSpeed's stage 1 does: no DDP needed,
    and the step sends exactly what `labkit.comm.step_communication("zero1")` counts.

    .optim is the local optimizer (of `optimizer_class(**defaults)`); .shard its one Parameter;
    .padding the zero elements appended to the flat buffer (below).

    Layout (what DeepSpeed's ZeRO-1/2 and FSDP's flat parameters do): the trainable parameters
    (the same dtype and device) are laid end to end in one flat buffer of P elements, padded
    with zeros to P_pad = N * ceil(P / N) so that it splits into N equal shards (a
    reduce-scatter and an all-gather need equal chunks). Rank r owns elements [r*S, (r+1)*S),
    S = P_pad / N, whichever tensors they belong to; the model's parameters become views of
    that buffer, and the local optimizer steps one Parameter that is a view of rank r's shard
    (no copy).

    Padding, exactly, per rank (P_pad - P < N elements): the replicated weights are the flat
    buffer, 4 * P_pad bytes (fp32) instead of 4 * P; every sharded state has S = P_pad / N
    elements instead of P / N: AdamW's two moments 8 * S bytes, ZeRO-2's gradient shard 4 * S.
    ZeRO-1's full gradients are the parameters' own (.grad, allocated by autograd): 4 * P, no
    padding. So measured = estimate_memory(P_pad, ...) term by term, except ZeRO-1's gradients
    = estimate_memory(P, ...).grads. Example: P = 1,385 on N = 4 -> P_pad = 1,388, S = 347: 12
    more bytes of weights and 8 * 347 = 2,776 bytes of moments instead of 2,770. torch's
    ZeroRedundancyOptimizer gives whole tensors to ranks instead (`partition_parameters`): no
    padding, but unequal shares.

    Rules: parameters are deduplicated by identity (a tied weight is one); frozen ones
    (requires_grad=False) are left alone. Construction broadcasts rank 0's values of the
    trainable parameters (one broadcast), so every replica starts equal. `step(closure)` is not
    supported.
    """

    def __init__(self, params, optimizer_class, *, reduce_gradients: bool = False, **defaults):
        name = type(self).__name__
        check_optimizer_class(name, optimizer_class)
        if reduce_gradients not in (True, False):
            raise ValueError(f"reduce_gradients={describe(reduce_gradients)}; allowed: True "
                             "(step() reduce-scatters each rank's own gradients) or False "
                             "(they are already averaged, e.g. by DDP)")
        params = _trainable(name, params)
        require_process_group(name)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.reduce_gradients = reduce_gradients
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = padded_size(self.numel, self.world_size) // self.world_size
        self.padding = self.shard_numel * self.world_size - self.numel
        self.flat = torch.zeros(self.shard_numel * self.world_size, dtype=params[0].dtype,
                                device=params[0].device)
        self._offsets = []
        offset = 0
        with torch.no_grad():
            for p in params:
                self.flat[offset:offset + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[offset:offset + p.numel()].view_as(p)   # a view, no copy
                self._offsets.append(offset)
                offset += p.numel()
            dist.broadcast(self.flat, src=0)          # every replica starts from rank 0's
        lo = self.rank * self.shard_numel
        self._range = (lo, lo + self.shard_numel)
        self.shard = nn.Parameter(self.flat[lo:lo + self.shard_numel])   # shares the storage
        self.optim = optimizer_class([self.shard], **defaults)

    # what schedulers and state_bytes read: the local optimizer's
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def _shard_gradient(self) -> torch.Tensor:
        """This rank's S gradient elements (zeros for padding and for parameters with none)."""
        if self.reduce_gradients:
            full = self._flat_gradients()
            out = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
            dist.reduce_scatter_single(out, full)
            return out.div_(self.world_size)
        lo, hi = self._range
        out = torch.zeros(self.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        for p, offset in zip(self.params, self._offsets):
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b and p.grad is not None:
                out[a - lo:b - lo].copy_(p.grad.reshape(-1)[a - offset:b - offset])
        return out

    def _flat_gradients(self) -> torch.Tensor:
        full = torch.zeros_like(self.flat)
        for p, offset in zip(self.params, self._offsets):
            if p.grad is not None:
                full[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        return full

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step(closure) is not supported; allowed: "
                             "step() after backward (closures re-run forward on one rank only)")
        self.shard.grad = self._shard_gradient()
        self.optim.step()
        self._after_step()
        with torch.no_grad():                     # the updated shards, to every rank
            dist.all_gather_single(self.flat, self.shard.detach().clone())

    def _after_step(self) -> None:
        self.shard.grad = None                    # a temporary: ZeRO-1 keeps full gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in [*self.params, self.shard]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


# ---------------------------------------------------------------------------------------------
# ZeRO-2: gradients sharded too


class ShardedGradientOptimizer(ShardedOptimizer):
    """ZeRO-2: as soon as backward has produced the last gradient, the gradients are
    reduce-scattered (sum / N) into this rank's shard and the full ones freed; step() is
    ZeRO-1's on that shard. No DDP: each rank passes its own gradients.

    Each backward (each micro-batch of gradient accumulation) reduce-scatters once and adds to
    the shard's gradient, which `zero_grad()` frees. A post-accumulate-grad hook copies each
    parameter's gradient into one flat buffer and frees it; the last one launches the
    reduce-scatter, and the buffer is freed after it. DeepSpeed fills fixed-size buckets
    (`reduce_bucket_size`) instead, so the whole buffer never exists at once; one bucket here
    keeps the code short. Every rank must compute a gradient for the same parameters (those
    with none at step() count as zeros).
    """

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self._arrived: set[int] = set()
        self._buffer = None
        # The hooks hold the optimizer weakly and go with it: a notebook cell run again builds
        # a new one on the same parameters, and the old one must stop reducing.
        ref = weakref.ref(self)
        hooks = [p.register_post_accumulate_grad_hook(partial(_grad_ready, ref, i))
                 for i, p in enumerate(self.params)]
        weakref.finalize(self, lambda: [h.remove() for h in hooks])

    def _grad_ready(self, i: int, p) -> None:
        if self._buffer is None:
            self._buffer = torch.zeros_like(self.flat)
        offset = self._offsets[i]
        self._buffer[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None                          # freed: the buffer has it
        self._arrived.add(i)
        if len(self._arrived) == len(self.params):
            self._reduce()

    def _reduce(self) -> None:
        out = torch.empty(self.shard_numel, dtype=self.flat.dtype, device=self.flat.device)
        dist.reduce_scatter_single(out, self._buffer)
        self._buffer, self._arrived = None, set()   # the full gradients are gone
        out.div_(self.world_size)
        if self.shard.grad is None:
            self.shard.grad = out
        else:
            self.shard.grad += out

    def _shard_gradient(self) -> torch.Tensor:
        if self._arrived:                          # some parameters got no gradient: zeros
            self._reduce()
        if self.shard.grad is None:
            raise RuntimeError(f"{type(self).__name__}.step() found no gradient: run backward "
                               "(on every rank) before step()")
        return self.shard.grad

    def _after_step(self) -> None:
        pass                                       # zero_grad() frees the shard's gradient


def _grad_ready(ref, i: int, p) -> None:
    opt = ref()
    if opt is not None:
        opt._grad_ready(i, p)


def _trainable(name: str, params) -> list:
    if isinstance(params, torch.Tensor):
        raise ValueError(f"params is one tensor; allowed: an iterable of parameters, e.g. "
                         f"model.parameters(), which {name} shards")
    try:
        items = list(params)
    except TypeError:
        raise ValueError(f"params={describe(params)} is not iterable; allowed: an iterable of "
                         "parameters, e.g. model.parameters()") from None
    unique, seen = [], set()
    for i, p in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"params[{i}]={describe(p)} is a {type(p).__name__}; allowed: "
                             "parameters (tensors), e.g. model.parameters() (parameter groups "
                             f"are not supported by {name})")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    if not unique:
        raise ValueError(f"params has no trainable parameter (requires_grad=True); allowed: "
                         f"the model's parameters, e.g. model.parameters(), for {name} to shard")
    kinds = {(p.dtype, p.device) for p in unique}
    if len(kinds) > 1:
        listed = ", ".join(f"{d} on {v}" for d, v in sorted(kinds, key=str))
        raise ValueError(f"params mix dtypes or devices ({listed}); allowed: one dtype on one "
                         f"device (the flat buffer {name} shards is one tensor)")
    return unique
