"""One FSDP2 step as a timeline: each unit's all-gathers and reduce-scatters and its forward and
backward compute, with start and end times (time.perf_counter, seconds from the step's start).

    rec = Timeline(model)            # a model sharded with labkit.parallel.fsdp.shard_model
    with rec:
        step()
    rec.events                       # [{"what", "unit", "start", "end", "bytes", "group"}]

How each event is read, and `in_flight`: `Timeline`'s docstring.
"""
from __future__ import annotations

import time

from labkit.runtime import measure

WRAPPED = ("unshard", "wait_for_unshard", "pre_backward", "post_backward")


def labels(n_units: int) -> list[str]:
    """block0 .. block{n-2}, then root (labkit.parallel.fsdp.units' order)."""
    return [f"block{i}" for i in range(n_units - 1)] + ["root"]


KINDS = {name: kind for name, (kind, _) in measure._C10D.items()}


class Timeline:
    """Record one step of a sharded model: `events` and `in_flight`.

    How it is read: each unit's FSDPParamGroup methods are wrapped for the `with` block (FSDP2
    calls them through the instance, so the wrappers see every call), and a TorchDispatchMode
    sees each c10d collective with its bytes (nccl-tests' S, as labkit.runtime.measure counts
    them).
    - "all_gather": issued inside the unit's `unshard` (its own pre-forward or pre-backward, or
      a prefetch from another unit), over `group` ranks (its output / its input); ends when the
      unit's `wait_for_unshard` returns (the copy-out into the unsharded parameters is done:
      compute can start).
    - "reduce_scatter": issued inside the unit's `post_backward`; ends when that call returns.
    - "forward": the unit's module forward, from a forward pre-hook that runs after FSDP2's (its
      all-gather waited for, its prefetches issued) to a forward hook that runs before FSDP2's
      reshard; "backward": from the unit's `pre_backward` returning to its `post_backward`
      starting. The root's spans contain the blocks' (the root's forward is the whole model's).
    `in_flight`: the most all-gathers issued and not yet waited for at one moment (1 without
    prefetching; an explicit forward prefetch of k blocks makes it up to k + 1)."""

    def __init__(self, model):
        from labkit.parallel.fsdp import units

        self.units = units(model)
        self.groups = [u._get_fsdp_state()._fsdp_param_group for u in self.units]
        self.names = labels(len(self.groups))
        self.events: list[dict] = []
        self._unit: list[str] = []          # the unit whose unshard/post_backward is running
        self._open: dict = {}               # (what, unit) -> event awaiting its end
        self._waiting = 0
        self.in_flight = 0

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _op(self, func, args) -> None:
        kind = KINDS.get(func._schema.name.split("::")[-1]) if func.namespace == "c10d" else None
        if kind in ("all_gather", "reduce_scatter"):
            full, part = (args[0], args[1]) if kind == "all_gather" else (args[1], args[0])
            nbytes = measure._nbytes(full)
            self.collective(kind, nbytes, nbytes // max(1, measure._nbytes(part)))

    def collective(self, kind: str, nbytes: int, group: int) -> None:
        unit = self._unit[-1] if self._unit else "?"
        event = dict(what=kind, unit=unit, start=self._now(), end=None, bytes=nbytes,
                     group=group)
        self.events.append(event)
        if kind == "all_gather":
            self._open[("all_gather", unit)] = event
            self._waiting += 1
            self.in_flight = max(self.in_flight, self._waiting)

    def _wrap(self, group, name: str, unit: str):
        original = getattr(group, name)

        def call(*args, **kwargs):
            if name in ("unshard", "post_backward"):
                self._unit.append(unit)
            if name == "post_backward":
                self._close(("backward", unit))
            try:
                out = original(*args, **kwargs)
            finally:
                if name in ("unshard", "post_backward"):
                    self._unit.pop()
            if name == "post_backward":
                for e in self.events:
                    if e["what"] == "reduce_scatter" and e["unit"] == unit and e["end"] is None:
                        e["end"] = self._now()
            elif name == "wait_for_unshard" and self._close(("all_gather", unit)):
                self._waiting -= 1
            elif name == "pre_backward":
                self._begin("backward", unit)
            return out

        setattr(group, name, call)

    def _begin(self, what: str, unit: str) -> None:
        event = dict(what=what, unit=unit, start=self._now(), end=None, bytes=0)
        self.events.append(event)
        self._open[(what, unit)] = event

    def _close(self, key) -> bool:
        event = self._open.pop(key, None)
        if event is not None:
            event["end"] = self._now()
        return event is not None

    def __enter__(self):
        self._t0 = time.perf_counter()
        for group, unit in zip(self.groups, self.names):
            for name in WRAPPED:
                self._wrap(group, name, unit)
        self._hooks = []
        for module, unit in zip(self.units, self.names):
            self._hooks.append(module.register_forward_pre_hook(
                lambda *_, u=unit: self._begin("forward", u)))
            self._hooks.append(module.register_forward_hook(
                lambda *_, u=unit: self._close(("forward", u)) and None, prepend=True))
        from labkit.labs.fsdp.build import op_mode

        self._mode = op_mode(before=self._op)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        end = self._now()
        for hook in self._hooks:
            hook.remove()
        for group in self.groups:
            for name in WRAPPED:
                group.__dict__.pop(name, None)      # the class's methods again
        for e in self.events:
            if e["end"] is None:
                e["end"] = end
        self.events.sort(key=lambda e: e["start"])
        return False

    def order(self) -> list[str]:
        """The step as the lesson writes it: 'AG(block0)', 'F(block0)', ..., 'RS(root)'."""
        short = {"all_gather": "AG", "reduce_scatter": "RS", "forward": "F", "backward": "B"}
        return [f"{short[e['what']]}({e['unit']})" for e in self.events]
