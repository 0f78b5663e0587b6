"""What the parts of the 3D lab (labkit.labs.threed) share: collectives counted per mesh axis,
model states per rank beside labkit.memory, the one-process reference, parameter parity.

Per axis: labkit.runtime.measure.CollectiveCounter records each collective's kind and bytes;
`AxisCounter` runs beside it and records the ranks of the process group each one ran on (the
c10d ops carry the ProcessGroup, the functional ones its name), so every event is attributed to
the mesh axis whose group it used ("tp", "dp", "pp", or "world" for the default group).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as tdist

from labkit.runtime import measure

CATEGORIES = ("params", "grads", "optimizer_states")


def _group_ranks(args) -> tuple | None:
    """The ranks of the process group among a collective op's arguments, or None."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        try:
            if isinstance(a, str):
                return tuple(tdist.get_process_group_ranks(_resolve_process_group(a)))
            if type(a).__name__ == "ScriptObject":
                return tuple(tdist.get_process_group_ranks(tdist.ProcessGroup.unbox(a)))
        except (RuntimeError, ValueError, KeyError):
            continue
    return None


class AxisCounter:
    """A CollectiveCounter that also knows each collective's group: `events` are
    (Collective, ranks) pairs, in issue order. Entered as one `with` block."""

    def __init__(self):
        self.counter = measure.CollectiveCounter()
        self.ranks: list = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        sink, tables = self.ranks, {"c10d": measure._C10D, "_c10d_functional": measure._FUNCTIONAL}

        class _Groups(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                    return NotImplemented           # as CollectiveCounter: see its comment
                name = func._schema.name.split("::")[-1]
                if name in tables.get(func.namespace, ()):
                    sink.append(_group_ranks(args))
                return func(*args, **(kwargs or {}))

        self.counter.__enter__()
        self._mode = _Groups()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self.counter.__exit__(*exc)
        return False

    @property
    def events(self) -> list:
        if len(self.ranks) != len(self.counter.events):
            raise RuntimeError(f"{len(self.counter.events)} collectives counted but "
                               f"{len(self.ranks)} groups seen")
        return list(zip(self.counter.events, self.ranks))

    def by_axis(self, mesh) -> dict:
        """{axis: {kind: [calls, bytes]}}: each collective under the mesh axis whose group
        (this rank's) it ran on; "world" for all ranks, "other" for any other group."""
        groups = {tuple(tdist.get_process_group_ranks(mesh[a].get_group())): a
                  for a in mesh.mesh_dim_names}
        world = tuple(range(tdist.get_world_size()))
        out: dict = {}
        for e, ranks in self.events:
            axis = groups.get(ranks, "world" if ranks in (None, world) else "other")
            row = out.setdefault(axis, {}).setdefault(e.kind, [0, 0])
            row[0] += 1
            row[1] += e.bytes
        return out


def axis_groups(mesh) -> dict:
    """{axis: [ranks of every group of that axis]} read from the DeviceMesh itself: the groups
    are the lines of the mesh's rank array along that dimension."""
    names = mesh.mesh_dim_names
    ranks = mesh.mesh
    out = {}
    for i, axis in enumerate(names):
        moved = ranks.movedim(i, -1).reshape(-1, ranks.shape[i])
        out[axis] = sorted(row.tolist() for row in moved)
    return out


def states_beside(model, opt, predicted) -> dict:
    """This rank's model states (measure.state_bytes: local shards) beside `predicted` (a
    labkit.memory.MemoryEstimate, or {category: bytes}), with measured/predicted ratios."""
    got = measure.state_bytes(model, opt)
    want = {c: float(getattr(predicted, c) if hasattr(predicted, c) else predicted[c])
            for c in CATEGORIES}
    measured = {c: getattr(got, c) for c in CATEGORIES}
    return dict(measured=measured, predicted=want, optimizer_steps=got.optimizer_steps,
                ratio={c: measured[c] / want[c] if want[c] else float("nan")
                       for c in CATEGORIES})


def vocab_collectives(spec, batch: int, seq: int, *, embed: bool = True, head: bool = True,
                      microbatches: int = 1, nbytes: int = 4) -> dict:
    """{kind: [calls, payload bytes]} on the tp axis of one step that labkit.parallel.mesh's
    vocab_plan adds to the layers' (step_communication("tp") counts the layers only), per
    micro-batch of `batch` x `seq` tokens: the vocab-parallel embedding's forward all-reduce
    (b s h), the column-parallel head's backward all-reduce of its input's gradient (b s h) and
    the forward all-gather of its logits (b s v: the loss takes them whole)."""
    bsh = batch * seq * spec.hidden_size * nbytes
    out = {}
    reduces = int(embed) + int(head)
    if reduces:
        out["all_reduce"] = [reduces * microbatches, reduces * microbatches * bsh]
    if head:
        out["all_gather"] = [microbatches, microbatches * batch * seq * spec.vocab_size * nbytes]
    return out


def merged(*predictions: dict) -> dict:
    """{kind: [calls, bytes]} summed over predictions of the same axis."""
    out: dict = {}
    for pred in predictions:
        for kind, (calls, nbytes) in pred.items():
            c, b = out.get(kind, [0, 0])
            out[kind] = [c + calls, b + nbytes]
    return out


def full(p) -> torch.Tensor:
    """A parameter whole: a DTensor gathered over its mesh (a collective: call on every rank
    of the mesh, in the same order), a plain tensor as is."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def quiet_redistribute() -> None:
    """Silence DTensor's warning that gathering a 2D-sharded parameter takes two all-gathers
    (true, and harmless for a checksum)."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def parity(module, names: dict, reference) -> dict:
    """`module`'s parameters gathered whole, beside the one-process `reference` model's (names:
    this module's parameter name -> the reference's): the checksum (sum of |x|, float64) of
    each and the largest |difference|."""
    quiet_redistribute()
    ref = dict(reference.named_parameters())
    mine = theirs = 0.0
    worst = 0.0
    for name, p in module.named_parameters():
        t, r = full(p).double(), ref[names[name]].detach().double()
        mine += t.abs().sum().item()
        theirs += r.abs().sum().item()
        worst = max(worst, (t - r).abs().max().item())
    return dict(checksum=mine, reference_checksum=theirs, max_param_diff=worst)


def stage_names(model, stage) -> dict:
    """{stage parameter name: model parameter name} for a stage that shares the model's
    parameters (labkit.parallel.pipe.split_model); call before sharding."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {n: by_id[id(p)] for n, p in stage.named_parameters()}


def reference_run(base, batches, lr: float):
    """(losses, model): one process trains a copy of `base` on each whole batch with AdamW,
    transformers' causal-LM loss."""
    from labkit.parallel.pipe import causal_lm_loss

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in batches:
        loss = causal_lm_loss(model(ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def mean_over(value: float, submesh) -> float:
    """The mean of `value` over the ranks of a DeviceMesh dimension (one all-reduce)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    tdist.all_reduce(t, group=submesh.get_group())
    return t.item() / submesh.size()


def ratios(measured: dict, predicted: dict, index: int) -> dict:
    """{axis: {kind: measured / predicted}} of calls (index 0) or bytes (1), for every kind
    predicted on an axis (0.0 when none was measured)."""
    return {axis: {kind: measured.get(axis, {}).get(kind, [0, 0])[index] / want[index]
                   for kind, want in kinds.items() if want[index]}
            for axis, kinds in predicted.items()}


def print_states(states: dict, what: str) -> None:
    m, p, ratio = states["measured"], states["predicted"], states["ratio"]
    print(f"  model states on this rank vs {what}:")
    for c in CATEGORIES:
        print(f"    {c:<17}{m[c]:>11,} B  predicted {p[c]:>13,.0f}  ratio {ratio[c]:.3f}")


def print_axes(r: dict) -> None:
    print("  collectives of one step per mesh axis (calls, payload bytes) vs labkit.comm:")
    for axis, kinds in r["predicted_collectives"].items():
        got = r["collectives"].get(axis, {})
        for kind, (calls, nbytes) in kinds.items():
            c, b = got.get(kind, [0, 0])
            print(f"    {axis:<3} {kind:<15} {c:>3} calls {b:>11,} B   predicted {calls:>3} "
                  f"{nbytes:>13,.0f} B   ratio calls {r['ratio_calls'][axis].get(kind, 0):.3f}"
                  f" bytes {r['ratio_bytes'][axis].get(kind, 0):.3f}")
    other = {a: k for a, k in r["collectives"].items() if a not in r["predicted_collectives"]}
    if other:
        print(f"    also: {other}")
