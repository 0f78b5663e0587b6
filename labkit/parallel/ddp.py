"""Data parallelism by hand: three DDPs, from the obvious one to the one torch ships.

    model = BucketedDDP(module, bucket_size_mb=25.0)   # or NaiveDDP(module), OverlappedDDP(module)
    loss_fn(model(x), y).backward()                    # x, y: this rank's shard
    model.finish_gradient_synchronization()            # every grad = the average over ranks
    optimizer.step(); optimizer.zero_grad()

The three differ only in when and in how many pieces the gradients are averaged (each class
says how; the rules they share: `_DataParallel`). After torch's DistributedDataParallel (Li et
al. 2020, "PyTorch Distributed", VLDB); what each costs per step: docs/labkit.md.
"""
from __future__ import annotations

import contextlib
import numbers
import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel import require_process_group
from labkit.validate import MAX_BYTES, describe, positive

MB = 2**20   # bucket sizes count MiB, as torch's bucket_cap_mb does


# ---------------------------------------------------------------------------------------------
# bucket assignment (a pure function: the lesson shows it on real and made-up sizes)

def assign_buckets(params_or_sizes, bucket_size_mb: float = 25.0) -> list[list[int]]:
    """Pack parameters into buckets: a list of buckets, each a list of indices into
    `params_or_sizes`, in the order they are filled (and launched).

    params_or_sizes: parameters (or tensors) in registration order, or their sizes in bytes.
    The items are taken in reverse order (the last layer's gradients are ready first). A bucket
    closes when adding the next item would pass `bucket_size_mb` MiB, or when the next tensor
    has another dtype or device (a bucket is one flat buffer); an item larger than the cap gets
    a bucket of its own. Pass each parameter once (`module.parameters()` gives a tied one once).

        assign_buckets([300, 500, 400, 100], bucket_size_mb=800 / 2**20)  # -> [[3, 2], [1, 0]]
    """
    cap = _bucket_bytes(bucket_size_mb)
    items = list(params_or_sizes)
    sizes, kinds = [], []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            sizes.append(item.numel() * item.element_size())
            kinds.append((item.dtype, item.device))
        elif isinstance(item, numbers.Integral) and not isinstance(item, bool) and item >= 0:
            sizes.append(int(item))
            kinds.append(None)
        else:
            raise ValueError(f"params_or_sizes[{i}]={describe(item)} is not a tensor or a size; "
                             "allowed: parameters (tensors) or whole numbers of bytes >= 0")
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(items))):
        if current and (filled + sizes[i] > cap or kinds[i] != kinds[current[-1]]):
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def _bucket_bytes(bucket_size_mb) -> float:
    return positive("bucket_size_mb", bucket_size_mb, at_most=MAX_BYTES / MB) * MB


# ---------------------------------------------------------------------------------------------
# what the three share: checks, the broadcast, the parameters to synchronise, no_sync

class _DataParallel(nn.Module):
    """The wrapper: `.module`, forward, the broadcast at construction, no_sync().

    Every rank holds the whole model and runs forward and backward on its own slice of the
    batch. After backward, each rank has the gradient of *its* loss; averaging the gradients
    over the N ranks gives every rank the gradient of the mean loss over the whole batch (the
    shards are the same size and the loss is a mean), so the same optimizer step keeps the
    replicas identical.

    Rules all three DDPs follow (as torch's DDP does, except where said):
    - Construction broadcasts rank 0's parameters (frozen ones included) and buffers, one
      broadcast per tensor, so every replica starts from the same weights.
    - A parameter used twice (tied embedding and output weights) is one Parameter: it is
      synchronised once (parameters are deduplicated by identity). A parameter with
      `requires_grad=False` is never synchronised, and keeps no gradient. The set of
      synchronised parameters is fixed at construction.
    - `no_sync()`: backward passes inside it accumulate gradients locally and communicate
      nothing (`finish_gradient_synchronization()` there does nothing); the first backward
      outside it synchronises the accumulated gradient. Gradient accumulation over k
      micro-batches therefore costs one synchronisation per optimizer step, not k.
    - Collectives are launched in the same order on every rank (gloo and NCCL match calls by
      their order): a group (a parameter, or a bucket) whose gradients are ready waits for the
      groups before it, as torch's reducer launches its buckets in order. Groups follow the
      reverse order of registration, so a model that registers its layers in another order
      than it runs them overlaps less (torch re-orders its buckets after the first iteration).
    - A parameter with no gradient after backward (unused in this forward, on this rank or all
      of them) contributes zeros: `finish_gradient_synchronization()` launches what its hook
      never did, so no rank waits forever for a collective another never issues, and
      afterwards it holds the average (zero if no rank used it). Its group, and the groups
      after it, go only then: an unused parameter costs overlap. torch's DDP without
      `find_unused_parameters=True` raises at the next iteration instead ("Expected to have
      finished reduction in the prior iteration"); with it, DDP walks the autograd graph after
      every forward to mark unused parameters ready, sends the same gradient bytes plus a small
      all-reduce of which parameters each rank used, and leaves a parameter no rank used with
      grad None (an optimizer skips it; here it gets a zero gradient, which weight decay or
      momentum still act on).
    """

    def __init__(self, module):
        name = type(self).__name__
        if not isinstance(module, nn.Module):
            raise ValueError(f"module={describe(module)} is a {type(module).__name__}; allowed: "
                             f"a torch.nn.Module (the model {name} replicates on every rank)")
        require_process_group(name)
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():      # every replica starts from rank 0's weights and buffers
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.detach(), src=0)
        # named_parameters() yields a tied Parameter once (deduplicated by identity)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, with no communication."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _grad(self, i: int) -> torch.Tensor:
        """Parameter i's gradient; zeros if it has none (unused): every rank still sends it."""
        p = self._params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad


# ---------------------------------------------------------------------------------------------
# 1. naive: after backward, one blocking all-reduce per parameter

class NaiveDDP(_DataParallel):
    """One all-reduce per parameter after backward; nothing overlaps.

    After backward, one blocking all-reduce per parameter, then divide by N: the whole
    communication time is added to the step, and each of the T tensors (one per bias and
    LayerNorm too) pays the latency once."""

    def finish_gradient_synchronization(self) -> None:
        """All-reduce every gradient, one after another; each becomes the average over ranks."""
        if not self._sync:
            return
        for i in range(len(self._params)):
            grad = self._grad(i)
            dist.all_reduce(grad)              # sum over ranks (gloo has no average)
            grad.div_(self.world_size)


# ---------------------------------------------------------------------------------------------
# what overlapped and bucketed share: hooks that launch groups of gradients, in order

def _on_grad_ready(wrapper_ref, i: int, param) -> None:
    """Parameter i's post-accumulate-grad hook: its gradient for this backward is complete."""
    wrapper = wrapper_ref()
    if wrapper is not None:
        wrapper._grad_ready(i)


class _HookedDDP(_DataParallel):
    """A hook on each parameter counts the gradients its group (one parameter, or a bucket)
    still waits for; a complete group is launched asynchronously, in group order."""

    def _start(self, groups: list[list[int]]) -> None:
        self._groups = groups
        self._group_of = {i: g for g, members in enumerate(groups) for i in members}
        # The hooks hold the wrapper weakly: a wrapper dropped (a notebook cell run again on
        # the same module) stops sending, and its hooks are removed with it.
        hooks = [p.register_post_accumulate_grad_hook(partial(_on_grad_ready, weakref.ref(self), i))
                 for i, p in enumerate(self._params)]
        weakref.finalize(self, lambda: [h.remove() for h in hooks])
        self._reset()

    def _reset(self) -> None:
        self._arrived = [False] * len(self._params)
        self._missing = [len(members) for members in self._groups]
        self._next = 0              # groups before this one are launched
        self._works = []            # their async handles

    def _grad_ready(self, i: int) -> None:
        if not self._sync:
            return                  # inside no_sync(): accumulate locally
        if self._arrived[i]:
            raise RuntimeError(
                f"{type(self).__name__}: a second backward reached {self._names[i]!r} before "
                "finish_gradient_synchronization(); call it after every backward outside "
                "no_sync() (to accumulate gradients, run the earlier backwards inside no_sync())")
        self._arrive(i)
        self._launch_ready()

    def _arrive(self, i: int) -> None:
        self._arrived[i] = True
        self._missing[self._group_of[i]] -= 1

    def _launch_ready(self) -> None:
        while self._next < len(self._groups) and self._missing[self._next] == 0:
            self._works.append(self._launch(self._next))
            self._next += 1

    def finish_gradient_synchronization(self) -> None:
        """Launch what backward did not (unused parameters send zeros), wait for every
        all-reduce, and leave each gradient the average over ranks."""
        if not self._sync:
            return
        for i in range(len(self._params)):
            if not self._arrived[i]:      # unused, or accumulated inside no_sync() only
                self._grad(i)
                self._arrive(i)
        self._launch_ready()
        for g, work in enumerate(self._works):
            work.wait()
            self._unpack(g)
        self._reset()


# ---------------------------------------------------------------------------------------------
# 2. overlapped: an async all-reduce per parameter, launched as soon as its gradient is ready

class OverlappedDDP(_HookedDDP):
    """An async all-reduce per parameter from its post-accumulate-grad hook.

    The hook (`register_post_accumulate_grad_hook`) fires when a parameter's gradient is
    complete and launches its all-reduce asynchronously (`async_op=True`), while autograd goes
    on with earlier layers; `finish_gradient_synchronization()` waits for the handles and
    divides. Still T messages, but what runs while the rest of backward computes is hidden."""

    def __init__(self, module):
        super().__init__(module)
        # one group per parameter, in reverse order of registration (the order grads are ready)
        self._start([[i] for i in reversed(range(len(self._params)))])

    def _launch(self, g: int):
        (i,) = self._groups[g]
        return dist.all_reduce(self._grad(i), async_op=True)

    def _unpack(self, g: int) -> None:
        (i,) = self._groups[g]
        self._params[i].grad.div_(self.world_size)


# ---------------------------------------------------------------------------------------------
# 3. bucketed: gradients packed into flat buffers, one async all-reduce per bucket

class BucketedDDP(_HookedDDP):
    """One async all-reduce per bucket of about `bucket_size_mb` MiB.

    Parameters in reverse order of registration (the order their gradients are ready: backward
    runs from the last layer to the first) are packed into buckets of about `bucket_size_mb`
    (`assign_buckets`); when the last gradient of a bucket arrives, the gradients are copied
    into the bucket's flat buffer and one async all-reduce sends them all. The few large
    messages cost memory (a flat buffer per bucket: one more copy of the gradients) and two
    copies per step (gradients in, averages out); torch's `gradient_as_bucket_view=True` makes
    the gradients views of the buckets: it saves that memory and the copy out, and the copy in
    too only while the gradients are zeroed in place (zero_grad(set_to_none=False))."""

    def __init__(self, module, bucket_size_mb: float = 25.0):
        _bucket_bytes(bucket_size_mb)          # refuse a bad size before touching the group
        super().__init__(module)
        self.bucket_size_mb = float(bucket_size_mb)
        groups = assign_buckets(self._params, bucket_size_mb)
        self._flat, self._views = [], []       # per bucket: the buffer, a view per parameter
        for members in groups:
            first = self._params[members[0]]
            flat = torch.zeros(sum(self._params[i].numel() for i in members),
                               dtype=first.dtype, device=first.device)
            views, offset = [], 0
            for i in members:
                n = self._params[i].numel()
                views.append(flat[offset:offset + n].view_as(self._params[i]))
                offset += n
            self._flat.append(flat)
            self._views.append(views)
        self._start(groups)

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names in each bucket, in launch order."""
        return [[self._names[i] for i in members] for members in self._groups]

    def _launch(self, g: int):
        for i, view in zip(self._groups[g], self._views[g]):
            view.copy_(self._grad(i))
        return dist.all_reduce(self._flat[g], async_op=True)

    def _unpack(self, g: int) -> None:
        self._flat[g].div_(self.world_size)
        for i, view in zip(self._groups[g], self._views[g]):
            self._params[i].grad.copy_(view)
