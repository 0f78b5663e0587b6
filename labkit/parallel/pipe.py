"""Pipeline parallelism by hand: GPipe and 1F1B over send/recv, picotron-style.

    stages = split_model(model, world)           # on every rank; keep stages[rank]
    loss, stats = one_f_one_b_step(stages[rank], split_batch(ids, ids, m), rank=rank,
                                   world=world, loss_fn=None)   # None: the stage's causal_lm_loss
    optimizer.step()                             # the gradients summed over the m micro-batches

Rank r holds stage r of p (`split_model`, in pipe_split.py); GPipe (Huang et al. 2019) and 1F1B
(PipeDream-Flush, Narayanan et al. 2021, §2.2) are `gpipe_step` and `one_f_one_b_step`, which
say what a step returns; how messages are sent: `_StageRun`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from labkit import validate
from labkit.parallel import require_process_group
from labkit.parallel.pipe_split import (BlockStage, CausalLMStage, SleepLayer, causal_lm_loss,
                                        split_batch, split_model)
from labkit.pipeline import as_events, idle_share


class _Held:
    """A tensor autograd saved for backward; tells its counter when autograd lets it go."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor, key, owner):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self):
        self.owner.release(self.key)


class _SavedBytes:
    """Bytes autograd holds for backward at this moment and at its peak (saved-tensor hooks),
    each storage once, the stage's parameters left out (model state, not activations)."""

    def __init__(self, module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.refs: dict = {}
        self.sizes: dict = {}
        self.live = self.peak = 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        if not self.refs.get(key):
            self.sizes[key] = t.untyped_storage().nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(t, key, self)

    def release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _StageRun:
    """One stage's side of one step: its micro-batches, its neighbours, the activations it
    holds for the backward, its clock and its event list.

    A micro-batch's activation goes forward from stage r to r + 1, its gradient comes back from
    r + 1 to r. Sends are non-blocking (isend), receives blocking. A blocking send returns only
    once the peer has taken the message (NCCL; gloo as well), so a stage would sit idle until
    its neighbour reached the matching receive: with isend it goes on with its next operation,
    like the simulator's stages, and waits for its sends only at the end of the step. A receive
    must block: the operation needs its data. Shapes are known in advance (the stage's
    `boundary` from the micro-batch's shape), so no message about shapes precedes the
    tensors."""

    def __init__(self, name, stage, microbatches, rank, world, loss_fn, group, timer):
        require_process_group(name)
        self.world, self.rank = _check_ranks(name, stage, rank, world, group)
        self.stage, self.data = stage, _check_microbatches(microbatches)
        self.m = len(self.data)
        self.first, self.last = rank == 0, rank == world - 1
        self.loss_fn = loss_fn if loss_fn is not None else getattr(stage, "loss_fn", None)
        if self.last and not callable(self.loss_fn):
            raise ValueError(f"loss_fn={loss_fn!r}: the last stage needs a loss; allowed: a "
                             "function loss_fn(output, target), or a stage with .loss_fn "
                             "(split_model's last stage of a transformers model)")
        self.group = group
        self.shape, self.dtype = _boundary(stage, self.data[0][0])
        self.held: dict = {}                  # micro-batch -> (input, output) for its backward
        self.peak = 0
        self.saved = _SavedBytes(stage)       # activation bytes held, measured
        self.loss = None
        self.sends: list = []                 # (work, tensor): isends still in flight
        self.p2p = {"sent": 0, "received": 0, "bytes_sent": 0, "bytes_received": 0}
        self.events: list[dict] = []
        self.clock = timer or time.perf_counter
        tdist.barrier(group=group)            # every rank leaves it at (nearly) the same time:
        self.t0 = self.clock()                # that instant is 0 on every rank's timeline

    def _peer(self, r):
        return r if self.group is None else tdist.get_global_rank(self.group, r)

    def _send(self, tensor, to):
        work = tdist.isend(tensor.contiguous(), self._peer(to), group=self.group)
        self.sends.append((work, tensor))     # keep the tensor alive until the send completes
        self.p2p["sent"] += 1
        self.p2p["bytes_sent"] += tensor.numel() * tensor.element_size()

    def _recv(self, frm):
        buf = torch.empty(self.shape, dtype=self.dtype)
        tdist.recv(buf, self._peer(frm), group=self.group)
        self.p2p["received"] += 1
        self.p2p["bytes_received"] += buf.numel() * buf.element_size()
        return buf

    def _event(self, kind, j, start):
        self.events.append({"stage": self.rank, "kind": kind, "microbatch": j, "chunk": 0,
                            "start": start - self.t0, "end": self.clock() - self.t0})

    def forward(self, j):
        inputs, target = self.data[j]
        if self.first:
            x = inputs                                        # the micro-batch itself
        else:
            x = self._recv(self.rank - 1).requires_grad_()   # stage r-1's activation; its
        start = self.clock()                                  # gradient goes back in backward
        with torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack):
            out = self.stage(x)
            if self.last:                                     # 1/m: the mean over the batch
                out = self.loss_fn(out, target) / self.m
        if self.last:
            self.loss = out.detach() if self.loss is None else self.loss + out.detach()
        self._event("F", j, start)
        self.held[j] = (x, out)                               # autograd keeps its graph alive
        self.peak = max(self.peak, len(self.held))
        if not self.last:
            self._send(out.detach(), self.rank + 1)           # activation to stage r+1

    def backward(self, j):
        grad = None if self.last else self._recv(self.rank + 1)   # dL/d(output) from r+1
        x, out = self.held.pop(j)
        start = self.clock()
        torch.autograd.backward(out, grad_tensors=grad)       # frees micro-batch j's graph
        self._event("B", j, start)
        if not self.first:
            self._send(x.grad, self.rank - 1)                 # dL/d(input) to stage r-1

    def finish(self, schedule):
        for work, _ in self.sends:                            # every message delivered
            work.wait()
        stats = {"schedule": schedule, "stage": self.rank, "stages": self.world,
                 "microbatches": self.m, "peak_in_flight": self.peak,
                 "peak_activation_bytes": self.saved.peak, "events": self.events,
                 "p2p": self.p2p, "step_time": self.clock() - self.t0}
        return self.loss, stats


def gpipe_step(stage_module, microbatches, *, rank, world, loss_fn=None, group=None,
               timer=None):
    """One GPipe training step of this rank's stage: every forward, then every backward.
    microbatches: [(input, target)] (`split_batch`), the same on every rank (stage 0 reads the
    inputs, the last stage the targets, all their shape). The gradients are accumulated into
    .grad (zero them before, step the optimizer after). timer: a clock in seconds (default
    time.perf_counter). Returns (loss or None, stats).

    GPipe (Huang et al. 2019): all m forwards, then all m backwards. A stage holds all m
    micro-batches' activations at once.

    The last stage divides each micro-batch's loss by m, so with equal micro-batches the
    gradients summed over them, and the loss returned, are the full batch's mean: parameters
    after an optimizer step equal a single process's. loss: a detached 0-dim tensor on the last
    stage, None on the others. In stats: "peak_in_flight", how many micro-batches' activations
    (autograd graphs) this stage held at once; "peak_activation_bytes", the bytes autograd had
    saved for backward at the peak (saved-tensor hooks, each storage once, parameters left
    out); "events", its operations as dicts {stage, kind "F"|"B", microbatch, chunk 0, start,
    end} in seconds from a start the ranks agree on (a barrier), comparable with
    `labkit.pipeline.simulate`'s events (`compare_events`, `labkit.pipeline.idle_share`). F
    and B time the compute only: the wait for a neighbour's message is idle time, as in the
    simulator; "p2p", the sends and receives (count and bytes)."""
    run = _StageRun("gpipe_step", stage_module, microbatches, rank, world, loss_fn, group, timer)
    for j in range(run.m):          # forwards 0..m-1: each activation kept, and sent to r+1
        run.forward(j)
    for j in range(run.m):          # backwards 0..m-1, in the same order as the forwards
        run.backward(j)
    return run.finish("gpipe")


def one_f_one_b_step(stage_module, microbatches, *, rank, world, loss_fn=None, group=None,
                     timer=None):
    """One 1F1B training step of this rank's stage (arguments and result as gpipe_step).

    1F1B (PipeDream-Flush, Narayanan et al. 2021, §2.2): stage r runs p - r - 1 forwards
    (warm-up), then one forward and one backward in turn (steady state), then the backwards
    left (cool-down). It holds at most p - r micro-batches. Same bubble as GPipe,
    (p-1)/(m+p-1)."""
    run = _StageRun("one_f_one_b_step", stage_module, microbatches, rank, world, loss_fn,
                    group, timer)
    m = run.m
    warmup = min(world - rank - 1, m)   # forwards before the first backward comes back
    for j in range(warmup):             # warm-up: fill the pipeline below this stage
        run.forward(j)
    for j in range(m - warmup):         # steady state: one forward, then the oldest backward
        run.forward(warmup + j)
        run.backward(j)
    for j in range(m - warmup, m):      # cool-down: the backwards still owed
        run.backward(j)
    return run.finish("1f1b")


def _check_ranks(name, stage, rank, world, group):
    """(world, rank) checked against the process group and the stage's own index."""
    size, me = tdist.get_world_size(group), tdist.get_rank(group)
    world = validate.positive_int("world", world)
    if world != size:
        raise ValueError(f"{name}: world={world} but the process group has {size} ranks; "
                         f"allowed: world={size} (one stage per rank)")
    if rank != me or isinstance(rank, bool):
        raise ValueError(f"{name}: rank={validate.describe(rank)} is not this process's rank "
                         f"in the group; allowed: rank={me}")
    stages, index = getattr(stage, "stages", world), getattr(stage, "index", rank)
    if stages != world or index != rank:
        raise ValueError(f"{name}: stage_module is stage {index} of {stages} "
                         f"(split_model(model, {stages})) on rank {rank} of world={world}; "
                         f"allowed: split_model(model, {world})[{rank}]")
    return world, rank


def _check_microbatches(microbatches):
    """A non-empty list of (input, target) pairs whose inputs share one shape."""
    try:
        pairs = [(x, y) for x, y in microbatches]
    except (TypeError, ValueError):
        raise ValueError(f"microbatches={validate.describe(microbatches)} must be a list of "
                         "(input, target) pairs; allowed: split_batch(inputs, targets, m)"
                         ) from None
    if not pairs:
        raise ValueError("microbatches=[] has no micro-batch; allowed: at least one "
                         "(input, target) pair")
    shapes = {tuple(x.shape) for x, _ in pairs}
    if len(shapes) > 1:
        raise ValueError(f"microbatches have inputs of shapes {sorted(shapes)}; allowed: one "
                         "shape (the stages receive tensors of a size fixed in advance)")
    return pairs


def _boundary(stage, batch):
    """(shape, dtype) of the activation between stages: the stage's own rule, or the input's
    (blocks that keep the shape of a floating-point input)."""
    if hasattr(stage, "boundary"):
        return stage.boundary(batch)
    if not batch.is_floating_point():
        raise ValueError(f"stage_module={type(stage).__name__} has no boundary(batch) and the "
                         f"micro-batches are {batch.dtype}; allowed: a split_model stage, or "
                         "a module with boundary(batch) -> (shape, dtype)")
    return tuple(batch.shape), batch.dtype


def gather_events(stats, group=None) -> list[dict]:
    """Every rank's stats["events"], on every rank, in time order (all_gather_object)."""
    require_process_group("gather_events")
    out = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, stats["events"], group=group)
    return sorted((e for events in out for e in events), key=lambda e: (e["start"], e["stage"]))


def stage_orders(events) -> dict:
    """{stage: [(kind, microbatch, chunk), ...]} in order of start time."""
    orders: dict = {}
    for e in sorted(as_events(events), key=lambda e: (e.start, e.stage)):
        orders.setdefault(e.stage, []).append((e.kind, e.microbatch, e.chunk))
    return orders


def compare_events(measured, simulated) -> dict:
    """A measured step (every rank's events) beside a simulated one (a PipelineResult or
    events): whether each stage ran the same operations in the same order, and the idle shares
    (`labkit.pipeline.idle_share`) with their difference in points of the step."""
    got, want = stage_orders(measured), stage_orders(simulated)
    stages = sorted(set(got) | set(want))
    differ = [s for s in stages if got.get(s) != want.get(s)]
    idle_m, idle_s = idle_share(measured, len(stages)), idle_share(simulated, len(stages))
    return {"same_order": not differ, "stages_out_of_order": differ,
            "idle_measured": idle_m, "idle_simulated": idle_s,
            "difference_points": 100 * (idle_m - idle_s)}


__all__ = ["split_model", "split_batch", "BlockStage", "CausalLMStage", "SleepLayer",
           "causal_lm_loss", "gpipe_step", "one_f_one_b_step", "gather_events", "stage_orders",
           "compare_events", "idle_share"]
