"""ZeRO-3 by hand: the weights are sharded too, and gathered only while a module needs them.

    model = FullyShardedModel(module, compute_dtype=None, shard=(nn.Linear, nn.Embedding))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the shards (and replicated params)
    loss = loss_fn(model(x), y); loss.backward()
    model.finish_gradient_synchronization(); opt.step(); opt.zero_grad()
    full = model.gather_full_params()                       # {name: full tensor}, for checks

Rajbhandari et al. 2020 (stage 3); what each rank holds, the hooks of a step and what they
send: `FullyShardedModel`. `labkit.parallel.fsdp` is the FSDP2 version the course moves to.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel import padded_size, require_process_group
from labkit.validate import describe


class _Gather(torch.autograd.Function):
    """shard -> full tensor (all-gather); backward: full gradient -> shard's (reduce-scatter)."""

    @staticmethod
    def forward(ctx, shard, owner, index, buffers):
        full, raw = owner._gather(index)
        buffers.append(raw)
        ctx.owner, ctx.index, ctx.raw = owner, index, raw
        return full

    @staticmethod
    def backward(ctx, grad_full):
        grad = ctx.owner._reduce_scatter(ctx.index, grad_full)
        ctx.raw.untyped_storage().resize_(0)       # the full weight is no longer needed
        return grad, None, None, None


class FullyShardedModel(nn.Module):
    """ZeRO-3: `.module` holds shards in place of the sharded parameters.

    Each parameter of a module whose type is in `shard` becomes a 1-D shard Parameter of
    S = ceil(numel / N) elements, registered under the same name (so
    `model.module.named_parameters()` and the optimizer see the shards): rank r keeps elements
    [r*S, (r+1)*S) of the flattened tensor, padded with zeros to N*S (fewer than N padding
    elements per tensor; `padded_size`), so a rank holds sum(S) elements of weights, gradients
    and each AdamW moment: per-rank bytes are estimate_memory(sum(padded_size(n, N)),
    zero_stage=3, dp=N) plus, for the replicated parameters, estimate_memory(R, zero_stage=0).
    Per step, for each such module:
    - forward pre-hook: all-gather each parameter (cast to `compute_dtype` first, so the gather
      and the compute run in it) into a buffer, put the full tensor in place of the shard;
    - forward post-hook: put the shards back and free the buffers (their storage is resized to
      0: what autograd saved for backward, e.g. a Linear's weight, keeps a handle but no bytes);
    - before the module's backward (a hook on its output's gradient): re-allocate and all-gather
      again, into the same storage;
    - the gather's backward: the full gradient (cast to fp32) is reduce-scattered (sum / N) into
      the shard's gradient, and the buffer freed.
    Parameters of other modules (norms, ...) are replicated: finish_gradient_synchronization()
    all-reduces their gradients (sum / N; zeros where a rank has none), as NaiveDDP does.
    Master shards, their gradients and the optimizer stay in the parameters' dtype (fp32); with
    compute_dtype, replicated parameters and the floating inputs of hooked modules are cast too.

    Per step and rank, for P sharded elements after padding (4 B each in fp32): all_gather 4P
    in the forward and 4P in the backward (in compute_dtype's bytes), reduce_scatter 4P: 1.5x
    DDP. A parameter shared by two sharded modules (tied embedding and head) is gathered and
    reduce-scattered by each (FSDP asks that tied weights share one unit for this reason).
    Construction broadcasts rank 0's parameters and buffers, so every rank starts equal. Every
    sharded module must run in every forward on every rank (collectives pair up in order).
    """

    def __init__(self, module, compute_dtype=None, shard=(nn.Linear, nn.Embedding)):
        name = type(self).__name__
        if not isinstance(module, nn.Module):
            raise ValueError(f"module={describe(module)} is a {type(module).__name__}; allowed: a "
                             f"torch.nn.Module (the model {name} shards over the ranks)")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype={describe(compute_dtype)}; allowed: None (compute in "
                             "the parameters' dtype) or a floating torch.dtype such as "
                             "torch.bfloat16 or torch.float16")
        shard = tuple(shard) if isinstance(shard, (tuple, list)) else (shard,)
        if not shard or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in shard):
            raise ValueError(f"shard={describe(shard)}; allowed: a tuple of torch.nn.Module "
                             "classes whose parameters are sharded, e.g. (nn.Linear, nn.Embedding)")
        if any(getattr(m, "_labkit_sharded", False) for m in module.modules()):
            raise ValueError(f"module is already sharded by a {name} (its parameters are shards "
                             "now); allowed: a model not wrapped yet (build it again, or keep "
                             "using the first wrapper)")
        require_process_group(name)
        super().__init__()
        self.module, self.compute_dtype = module, compute_dtype
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.detach(), src=0)
        self._shards, self._meta = [], []     # per sharded parameter: shard, (shape, numel, S)
        index_of = {}                         # id(original parameter) -> index (tied: one)
        self._units = []                      # (module, [(param name, index)], [replicated names])
        for sub in module.modules():
            own = list(sub._parameters.items())
            if not own:
                continue
            if isinstance(sub, shard):
                names = []
                for pname, p in own:
                    if p is None:
                        continue
                    if id(p) not in index_of:
                        index_of[id(p)] = self._make_shard(p)
                    names.append((pname, index_of[id(p)]))
                for pname, i in names:
                    sub._parameters[pname] = self._shards[i]
                sub._labkit_sharded = True
                self._units.append((sub, names))
            elif compute_dtype is not None:
                self._units.append((sub, []))
        self._replicated = [p for p in module.parameters()
                            if p.requires_grad and all(p is not s for s in self._shards)]
        ref = weakref.ref(self)
        for sub, names in self._units:
            sub.register_forward_pre_hook(_pre_forward(ref, names), with_kwargs=True)
            sub.register_forward_hook(_post_forward(ref, names))

    # ---- shards ------------------------------------------------------------------------------

    def _make_shard(self, p) -> int:
        n = p.numel()
        s = padded_size(n, self.world_size) // self.world_size
        flat = torch.zeros(s * self.world_size, dtype=p.dtype, device=p.device)
        flat[:n].copy_(p.detach().reshape(-1))
        piece = flat[self.rank * s:(self.rank + 1) * s].clone()    # only 1/N stays
        self._shards.append(nn.Parameter(piece, requires_grad=p.requires_grad))
        self._meta.append((p.shape, n, s))
        return len(self._shards) - 1

    def _gather(self, i: int):
        """(full tensor in compute dtype, its raw padded buffer) for sharded parameter i."""
        shape, n, s = self._meta[i]
        shard = self._shards[i].detach()
        dtype = self.compute_dtype or shard.dtype
        raw = torch.empty(s * self.world_size, dtype=dtype, device=shard.device)
        dist.all_gather_single(raw, shard.to(dtype))
        return raw[:n].view(shape), raw

    def _regather(self, i: int, raw) -> None:
        """All-gather parameter i again into `raw` (freed after forward), before its backward."""
        shape, n, s = self._meta[i]
        raw.untyped_storage().resize_(raw.numel() * raw.element_size())
        # through .data: autograd saved this storage; refilling it is not an in-place edit of
        # what it saved (the same values come back), so its version counter must not move
        dist.all_gather_single(raw.data, self._shards[i].detach().to(raw.dtype))

    def _reduce_scatter(self, i: int, grad_full):
        shape, n, s = self._meta[i]
        shard = self._shards[i]
        full = torch.zeros(s * self.world_size, dtype=shard.dtype, device=shard.device)
        full[:n].copy_(grad_full.reshape(-1))            # fp32 (master) precision
        out = torch.empty(s, dtype=shard.dtype, device=shard.device)
        dist.reduce_scatter_single(out, full)
        return out.div_(self.world_size)

    # ---- the contract -----------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """All-reduce (average) the replicated parameters' gradients; the shards' gradients were
        reduce-scattered during backward. Afterwards every trainable parameter has a gradient
        of its own shape and dtype (zeros if it was not used)."""
        for p in [*self._replicated, *(s for s in self._shards if s.requires_grad)]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for p in self._replicated:
            dist.all_reduce(p.grad)
            p.grad.div_(self.world_size)

    @torch.no_grad()
    def gather_full_params(self) -> dict:
        """{name: full tensor} for every parameter name of the wrapped module (a tied weight
        under each of its names), in the shards' dtype (fp32 masters)."""
        index = {id(s): i for i, s in enumerate(self._shards)}
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in index:
                shape, n, s = self._meta[index[id(p)]]
                raw = torch.empty(s * self.world_size, dtype=p.dtype, device=p.device)
                dist.all_gather_single(raw, p.detach())
                out[name] = raw[:n].view(shape)
            else:
                out[name] = p.detach().clone()
        return out


# ---- hooks (they hold the wrapper weakly: a dropped wrapper's model stops gathering) -------

def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def _pre_forward(ref, names):
    def hook(module, args, kwargs):
        self = ref()
        if self is None:
            return None
        buffers = []
        module._labkit_zero3 = buffers
        for pname, i in names:
            module._parameters[pname] = _Gather.apply(self._shards[i], self, i, buffers)
        dtype = self.compute_dtype
        if dtype is not None:
            sharded = {n for n, _ in names}
            module._labkit_replicated = {n: p for n, p in module._parameters.items()
                                         if p is not None and n not in sharded}
            for pname, p in module._labkit_replicated.items():
                module._parameters[pname] = p.to(dtype)          # differentiable cast
            args = tuple(_cast(a, dtype) for a in args)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        return args, kwargs
    return hook


def _post_forward(ref, names):
    def hook(module, args, output):
        self = ref()
        if self is None:
            return None
        for pname, i in names:
            module._parameters[pname] = self._shards[i]
        if self.compute_dtype is not None:
            module._parameters.update(module._labkit_replicated)
        buffers = module._labkit_zero3
        gathered = [(i, raw) for (_, i), raw in zip(names, buffers)]
        for raw in buffers:
            raw.untyped_storage().resize_(0)                     # freed after forward
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        needs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if gathered and needs:
            done = []

            def regather(grad):
                if not done:                     # once per forward, before the module's backward
                    done.append(True)
                    for i, raw in gathered:
                        self._regather(i, raw)
            for o in needs:
                o.register_hook(regather)
        return None
    return hook
