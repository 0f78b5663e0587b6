"""Inside a rank: what this rank holds, saves and sends, measured exactly (the why: comments below).

    s = measure.state_bytes(model, optimizer)  # params, grads, optimizer_states, optimizer_steps
    with measure.SavedActivations(model) as saved:   # saved.bytes: kept for backward,
        loss = model(x).sum()                        #   parameters excluded
    with measure.CollectiveCounter() as comm:        # comm.by_kind: {"all_reduce":
        loss.backward()                              #   (count, bytes), ...}
    timer = measure.StepTimer()                      # `with timer: step()` times one step

No process group is needed, so all of it works (and is tested) in one process too.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# model states
#
# Memory is counted by deduplicated storages, not process RSS: the allocator and a ~220 MB
# import baseline make RSS useless for bytes (PROBES.md).


def _local(t):
    """The local tensor of a DTensor (FSDP2/TP shard), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    t = to_local() if callable(to_local) else t
    # DTensor's redistributions may hand back an AsyncCollectiveTensor (a wrapper whose own
    # storage is invalid): wait for it and take the real tensor
    wait = getattr(t, "trigger_wait", None)
    return wait() if callable(wait) else t


def _storage_key(t) -> tuple:
    s = _local(t).untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr())


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped): a view, or a
    tensor sharing a storage already counted (in `seen`, updated), costs nothing. How the DDP
    lab shows gradient_as_bucket_view saving one copy of the gradients."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = _local(t)
        storage = local.untyped_storage()
        key = (local.device.type, local.device.index, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@dataclass(frozen=True)
class StateBytes:
    """Bytes this rank holds for the model's state (local shards for DTensor/FSDP2 parameters,
    padding included because it is memory held)."""

    params: int
    grads: int
    optimizer_states: int     # moments etc. (AdamW: exp_avg, exp_avg_sq)
    optimizer_steps: int      # AdamW's 4-byte `step` tensor per parameter tensor, apart

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.optimizer_steps


def _optimizers(optimizer) -> list:
    """The optimizer and the local one it wraps, if any: labkit's ShardedOptimizer and torch's
    ZeroRedundancyOptimizer keep this rank's shard in `.optim`."""
    inner = getattr(optimizer, "optim", None)
    return [optimizer] + ([inner] if hasattr(inner, "state") else [])


def state_bytes(model, optimizer=None) -> StateBytes:
    """Deduplicated storage bytes of parameters, gradients and optimizer states on this rank.

    What the optimizer holds counts too: the tensors it updates (its param_groups; a ZeRO shard
    that is a view of the model's parameters adds nothing, a separate copy such as fp32 master
    weights counts as optimizer state), their gradients (a ZeRO-2 gradient shard), and the
    states of the local optimizer a sharded one wraps (ShardedOptimizer,
    ZeroRedundancyOptimizer)."""
    params = list(model.parameters())
    seen: set = set()
    p_bytes = storage_bytes(params, seen)
    g_bytes = storage_bytes((p.grad for p in params), seen)
    o_bytes = s_bytes = 0
    optimizers = [] if optimizer is None else _optimizers(optimizer)
    held = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    o_bytes += storage_bytes(held, seen)
    g_bytes += storage_bytes((p.grad for p in held), seen)
    for opt in optimizers:
        for state in opt.state.values():
            for name, value in state.items():
                if not hasattr(value, "untyped_storage"):
                    continue
                if name == "step":
                    s_bytes += storage_bytes([value], seen)
                else:
                    o_bytes += storage_bytes([value], seen)
    return StateBytes(p_bytes, g_bytes, o_bytes, s_bytes)


# ---------------------------------------------------------------------------------------------
# activations saved for backward


class SavedActivations:
    """Count the bytes autograd saves for backward inside the `with` block.

    Keyed by storage, so a tensor saved by two ops (a ReLU's output that the next Linear also
    saves) counts once, and parameters and their views (the `weight.t()` a Linear saves) are
    excluded: they are model state, counted by `state_bytes`. Pass the modules (or parameters)
    whose parameters to exclude.
    """

    def __init__(self, *modules_or_params):
        self._exclude_from = modules_or_params
        self.bytes = 0
        self.count = 0
        self.by_dtype: dict[str, int] = defaultdict(int)
        self._seen: set = set()
        self._ctx = None

    def _pack(self, t):
        key = _storage_key(t)
        if key not in self._seen and key not in self._params:
            self._seen.add(key)
            n = _local(t).untyped_storage().nbytes()
            self.bytes += n
            self.count += 1
            self.by_dtype[str(t.dtype).replace("torch.", "")] += n
        return t

    def __enter__(self):
        import torch

        self._params = set()
        for item in self._exclude_from:
            ps = item.parameters() if hasattr(item, "parameters") else [item]
            self._params.update(_storage_key(p) for p in ps)
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


# ---------------------------------------------------------------------------------------------
# CUDA peak memory


def peak_memory(device=None) -> int | None:
    """torch.cuda.max_memory_allocated (bytes) on CUDA; None on CPU (use state_bytes and
    SavedActivations there: they are exact)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device)


def reset_peak_memory(device=None) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------
# collectives
#
# Seen at the dispatcher (a TorchDispatchMode), where DDP's all-reduce, FSDP2's all-gather/
# reduce-scatter, DTensor's functional collectives and pipeline send/recv all pass with their
# tensors (PROBES.md). The bytes of a collective are the size of its full buffer, as nccl-tests'
# "size": the tensor reduced (all_reduce), the gathered output (all_gather), the unsharded input
# (reduce_scatter), the tensor sent (broadcast, send/recv, all_to_all). What a ring moves per
# rank follows from that (labkit.comm); what gloo actually sends is another matter (PROBES.md:
# its reduce_scatter is an all_reduce).

# op name -> (kind, index of the argument holding the full buffer; None: no payload; "group":
# the functional all-gathers, whose full buffer is their input times group_size = args[1];
# "pgN": gather and scatter, whose full buffer (nccl-tests' size: every rank's chunk) is the
# chunk in args[N] times the size of the process group in args[2]: the root's list is empty
# on the other ranks)
_C10D = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0), "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0),
    "gather_": ("gather", "pg1"), "scatter_": ("scatter", "pg0"),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", "group"),
    "all_gather_into_tensor_out": ("all_gather", "group"),
    "all_gather_into_tensor_coalesced": ("all_gather", "group"),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "broadcast": ("broadcast", 0), "broadcast_": ("broadcast", 0),
    "all_to_all_single": ("all_to_all", 0), "isend": ("send", 0), "irecv": ("recv", 0),
    "batch_p2p_ops": ("p2p", 3),
}


def _nbytes(obj) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if hasattr(obj, "element_size"):
        return obj.numel() * obj.element_size()
    return 0


def _group_size(group) -> int:
    """The size of a process group as the dispatcher passes it (a ScriptObject)."""
    import torch.distributed as dist
    size = getattr(group, "size", None)
    return size() if callable(size) else dist.ProcessGroup.unbox(group).size()


def _dtype(obj):
    if isinstance(obj, (list, tuple)):
        return next((d for d in map(_dtype, obj) if d), None)
    return str(obj.dtype).replace("torch.", "") if hasattr(obj, "dtype") else None


@dataclass(frozen=True)
class Collective:
    kind: str        # all_reduce | all_gather | reduce_scatter | broadcast | send | recv | ...
    op: str          # the dispatcher op, e.g. "c10d.allreduce_"
    bytes: int       # size of the full buffer (see the comment above _C10D)
    dtype: str | None


def _make_counter_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Mode(TorchDispatchMode):
        def __init__(self, sink):
            super().__init__()
            self.sink = sink

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # DTensor arguments: let DTensor's own dispatch run first; the collectives it
            # issues come back through this mode as plain tensors (else they would be missed).
            if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                return NotImplemented
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            table = _C10D if ns == "c10d" else _FUNCTIONAL if ns == "_c10d_functional" else None
            if table is not None and name in table:
                kind, where = table[name]
                if where is None:
                    nbytes = 0
                elif where == "group":          # (input, group_size, group_name)
                    nbytes = _nbytes(args[0]) * int(args[1])
                elif where in ("pg0", "pg1"):   # (out, in, process_group, root, ...)
                    nbytes = _nbytes(args[int(where[2])]) * _group_size(args[2])
                else:
                    nbytes = _nbytes(args[where])
                self.sink.append(Collective(kind, f"{ns}.{name}", nbytes,
                                            _dtype(args[0]) if args else None))
            return func(*args, **kwargs)

    return _Mode


@dataclass
class CollectiveCounter:
    """Record every collective issued in the `with` block: kind, count and bytes.

    comm.by_kind -> {"all_reduce": (count, bytes), ...}; comm.events is the full list. Measure
    after a warm-up step (DDP rebuilds its buckets after the first, FSDP initialises lazily).
    """

    events: list[Collective] = field(default_factory=list)

    @property
    def by_kind(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = {}
        for e in self.events:
            c = out.setdefault(e.kind, [0, 0])
            c[0] += 1
            c[1] += e.bytes
        return {k: (c, b) for k, (c, b) in sorted(out.items())}

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    def __enter__(self):
        self._mode = _make_counter_mode()(self.events)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def comm_debug_mode():
    """torch's own CommDebugMode (counts per module, no bytes); for the per-module view."""
    from torch.distributed.tensor.debug import CommDebugMode

    return CommDebugMode()


# ---------------------------------------------------------------------------------------------
# time


class StepTimer:
    """Wall time of steps: `with timer:` times one step. The first `warmup` steps are kept in
    `all_times` but left out of the statistics (first steps pay for lazy initialisation).
    On CUDA pass sync=True so a step's kernels are finished before its time is read."""

    def __init__(self, warmup: int = 1, sync: bool = False):
        self.warmup = warmup
        self.sync = sync
        self.all_times: list[float] = []

    def _sync(self):
        if self.sync:
            import torch
            if torch.cuda.is_available():
                torch.cuda.synchronize()

    def __enter__(self):
        self._sync()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.all_times.append(time.perf_counter() - self._t)
        return False

    @property
    def times(self) -> list[float]:
        return self.all_times[self.warmup:]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times) if self.times else float("nan")

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def summary(self) -> dict:
        return {"steps": len(self.times), "mean_s": self.mean, "median_s": self.median,
                "min_s": min(self.times, default=float("nan"))}
