"""The FSDP lab's --part options and --part fsdp1 (labkit.labs.fsdp runs them).

    labkit run fsdp -n 4 -- --part options --model gpt2                # every option, measured
    labkit run fsdp -n 2 -- --part fsdp1                               # FSDP1 beside FSDP2

labkit.labs.fsdp.lab calls run_options / run_fsdp1 (args, ctx) and print_options / print_fsdp1:
each option of labkit.parallel.fsdp.shard_model (OPTIONS) against the default, and FSDP1's
FULL_SHARD and SHARD_GRAD_OP against FSDP2, beside labkit.fsdp's fsdp_memory and
fsdp_communication. What each measures, and how exactly: docs/labs.md, ## fsdp.
"""
from __future__ import annotations

import copy
import time
import warnings

import torch

from labkit.labs.fsdp.build import GatheredPeak, adamw, build, wire_payload
from labkit.runtime import measure

OPTIONS = {"whole": dict(per_block=False), "keep": dict(reshard_after_forward=False),
           "reshard2": dict(reshard_after_forward=2),
           "bf16": dict(param_dtype="bf16", reduce_dtype="fp32"),
           "bf16_reduce": dict(param_dtype="bf16", reduce_dtype="bf16"),
           "prefetch1": dict(prefetch=1), "prefetch2": dict(prefetch=2),
           "checkpoint": dict(checkpoint_blocks=True), "offload": dict(offload=True)}
WARMUP = 1
TERMS = ("params", "grads", "optimizer_states")


class Saved:
    """Bytes autograd saves in the `with` block, FSDP2's parameters excluded (their storages
    are looked up when a tensor is saved: gathered weights come and go), plus the inputs of
    checkpointed blocks (what non-reentrant checkpointing keeps to recompute them)."""

    def __init__(self, model, blocks=()):
        from labkit.labs.fsdp.build import param_groups

        self.params = [fp for g in param_groups(model) for fp in g.fsdp_params]
        self.blocks, self.bytes, self._seen = list(blocks), 0, set()

    def _excluded(self) -> set:
        out = set()
        for fp in self.params:
            for t in (fp.sharded_param, getattr(fp, "_unsharded_param", None),
                      *(getattr(fp, "all_gather_outputs", None) or [])):
                if t is not None:
                    out.add(measure._storage_key(t))
        return out

    def _count(self, t) -> None:
        key = measure._storage_key(t)
        if key not in self._seen and key not in self._excluded():
            self._seen.add(key)
            self.bytes += measure._local(t).untyped_storage().nbytes()

    def _pack(self, t):
        self._count(t)
        return t

    def __enter__(self):
        self._hooks = [b.register_forward_pre_hook(
            lambda m, args, kwargs: self._count(args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True) for b in self.blocks]
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        return False


def _tracker_peak(model, opt, step) -> dict:
    """{category: bytes} at the step's peak, as torch's FSDPMemTracker names them."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    tracker = FSDPMemTracker(model, opt)
    with tracker:
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(getattr(k, "value", k)): v for k, v in peak.items()}


def run_options(args, ctx) -> dict:
    from labkit.fsdp import fsdp_communication, fsdp_memory, unit_params
    from labkit.labs.fsdp.timeline import Timeline
    from labkit.labs.common.training import barrier, global_batch, median, shard
    from labkit.labs.fsdp.build import mean_over_ranks
    from labkit.memory import estimate_memory
    from labkit.parallel.fsdp import shard_model, transformer_blocks

    N = ctx.world_size
    base, spec = build(args, ctx.device)
    units = unit_params(spec)
    assert sum(units) == sum(p.numel() for p in base.parameters())
    skipped = {}
    if "reshard2" in args.option and (N <= 2 or N % 2):
        skipped["reshard2"] = (f"reshard_after_forward=2 needs an even world size above 2 "
                               f"(2 is the whole world: True); this run has {N}")
    names = ["default"] + [o for o in args.option if o not in skipped]
    runs = {}
    for name in names:
        model = shard_model(copy.deepcopy(base), **OPTIONS.get(name, {}))
        runs[name] = dict(model=model, opt=adamw(model, args.lr), losses=[], times=[])
    counted = {}
    for step in range(args.steps + 1):        # + 1: the FSDPMemTracker step, not timed
        ids = shard(global_batch(args, N, step), ctx)
        for name, run in runs.items():
            model, opt = run["model"], run["opt"]

            def one():
                loss = model(ids)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return loss.item()

            barrier(ctx)
            if step == WARMUP:
                blocks = transformer_blocks(model) if name == "checkpoint" else ()
                with measure.CollectiveCounter() as comm, GatheredPeak(model) as g, \
                        Timeline(model) as tl:
                    with Saved(model, blocks) as saved:
                        loss = model(ids)
                    held = g.now()
                    loss.backward()
                    opt.step()
                    states = measure.state_bytes(model, opt)
                    opt.zero_grad()
                run["losses"].append(loss.item())
                counted[name] = (comm, g, tl, saved.bytes, held, states)
            elif step == WARMUP + 1:
                peak = {}
                run["losses"].append(None)
                run["tracker"] = _tracker_peak(model, opt, lambda: peak.setdefault("l", one()))
                run["losses"][-1] = peak["l"]
            else:
                t = time.perf_counter()
                run["losses"].append(one())
                if step > WARMUP + 1:
                    run["times"].append(time.perf_counter() - t)

    losses = mean_over_ranks({k: r["losses"] for k, r in runs.items()}, ctx)
    out = dict(part="options", rank=ctx.rank, world_size=N, model=args.model, steps=args.steps,
               layers=args.layers, hidden=args.hidden, batch=args.batch, seq=args.seq,
               num_params=sum(units), units=units, options=names, skipped=skipped,
               losses=losses, results={})
    for name, run in runs.items():
        kw = OPTIONS.get(name, {})
        comm, g, tl, saved, held, states = counted[name]
        dtype = {"bf16": "bf16", None: "fp32"}.get(kw.get("param_dtype"))
        reduce = kw.get("reduce_dtype", dtype)
        mp = dict(param_dtype=dtype, reduce_dtype=reduce)
        shape = dict(per_block=kw.get("per_block", True),
                     reshard_after_forward=kw.get("reshard_after_forward", True))
        want = wire_payload(fsdp_communication(spec, N, **shape, **mp))
        got = comm.by_kind
        mem = fsdp_memory(spec, N, **shape, **mp, prefetch=kw.get("prefetch", 0),
                          offload=kw.get("offload", False))
        sharded = (mem.host if kw.get("offload") else mem.model_states)
        recompute = "full" if kw.get("checkpoint_blocks") else "none"
        acts = estimate_memory(spec, batch_size=args.batch, seq_len=args.seq,
                               precision="fp32" if dtype == "fp32" else "bf16-mixed",
                               zero_stage=3, dp=N, recompute=recompute,
                               dropout=False).activations
        ags = [e for e in tl.events if e["what"] == "all_gather"]
        res = dict(
            collectives={op: {"calls": c, "bytes": b} for op, (c, b) in got.items()},
            predicted_collectives={op: {"calls": c, "bytes": b} for op, (c, b) in want.items()},
            ratio_collectives={op: got.get(op, (0, 0))[1] / b for op, (_, b) in want.items()},
            reduce_scatter_dtype=sorted({e.dtype for e in comm.events
                                         if e.kind == "reduce_scatter"}),
            all_gather_dtype=sorted({e.dtype for e in comm.events if e.kind == "all_gather"}),
            all_gather_groups=[e.get("group") for e in ags],
            held=held, peak=g.peak, predicted_held=mem.unsharded_held,
            predicted_peak=mem.unsharded_peak,
            ratio_held=(held / mem.unsharded_held if mem.unsharded_held
                        else (1.0 if held == 0 else None)),
            ratio_peak=g.peak / mem.unsharded_peak,
            states=sum(getattr(states, t) for t in TERMS), predicted_states=sharded,
            ratio_states=sum(getattr(states, t) for t in TERMS) / sharded,
            saved_activations=saved, predicted_activations=acts,
            ratio_activations=saved / acts, in_flight=tl.in_flight, order=tl.order(),
            tracker_peak=run["tracker"], step_s=median(run["times"]),
            loss_max_diff=max(abs(a - b) for a, b in zip(losses[name], losses["default"])))
        out["results"][name] = res
    d = out["results"]["default"]
    for res in out["results"].values():
        res["step_vs_default"] = res["step_s"] / d["step_s"]
        res["saved_vs_default"] = res["saved_activations"] / d["saved_activations"]
    out["note"] = ("offload: CPUOffloadPolicy runs, but on a CPU-only machine host and device "
                   "memory are the same: no benefit can show here (on a GPU the sharded "
                   "states leave the device and each step pays the PCIe copies: "
                   "labkit.offload.offload_cost)")
    return out


def print_options(r: dict) -> None:
    print(f"transformers {r['model']} from config: {r['layers']} blocks, h {r['hidden']}, "
          f"{r['num_params']:,} parameters; {r['world_size']} ranks; units {r['units']}")
    print(f"{'option':<12}{'AG calls/S':>18}{'RS calls/S':>18}{'ratio':>7}{'RS dtype':>10}"
          f"{'held':>10}{'peak':>10}{'ratios':>12}{'saved act':>11}{'x dflt':>7}{'in flight':>10}"
          f"{'step ms':>9}{'x dflt':>7}{'loss diff':>10}")
    for name, s in r["results"].items():
        ag, rs = (s["collectives"].get(k, {"calls": 0, "bytes": 0})
                  for k in ("all_gather", "reduce_scatter"))
        ratio = min(s["ratio_collectives"].values())
        rh = "-" if s["ratio_held"] is None else f"{s['ratio_held']:.3f}"
        print(f"{name:<12}{ag['calls']:>4}x {ag['bytes']:>11,}{rs['calls']:>4}x {rs['bytes']:>11,}"
              f"{ratio:>7.3f}{','.join(s['reduce_scatter_dtype']):>10}{s['held']:>10,}"
              f"{s['peak']:>10,}{rh + '/' + format(s['ratio_peak'], '.3f'):>12}"
              f"{s['saved_activations']:>11,}{s['saved_vs_default']:>7.2f}{s['in_flight']:>10}"
              f"{1e3 * s['step_s']:>9.1f}{s['step_vs_default']:>7.2f}{s['loss_max_diff']:>10.1e}")
    for name, why in r["skipped"].items():
        print(f"{name}: skipped: {why}")
    print(r["note"])


def run_fsdp1(args, ctx) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from labkit.fsdp import fsdp_communication
    from labkit.labs.common.training import barrier, global_batch, shard
    from labkit.labs.fsdp.build import mean_over_ranks
    from labkit.labs.common.zero_stages import reference
    from labkit.parallel.fsdp import shard_model, transformer_blocks

    base, spec = build(args, ctx.device)
    block = type(transformer_blocks(base)[0])
    models, caught = {}, []
    for name, strategy in (("full_shard", ShardingStrategy.FULL_SHARD),
                           ("shard_grad_op", ShardingStrategy.SHARD_GRAD_OP)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            models[name] = FullyShardedDataParallel(
                copy.deepcopy(base), sharding_strategy=strategy, use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy({block}), device_id=ctx.device)
        caught += [f"{w.category.__name__}: {w.message}" for w in seen]
    models["fsdp2"] = shard_model(copy.deepcopy(base))
    opts = {k: adamw(m, args.lr) for k, m in models.items()}
    losses, counted = {k: [] for k in models}, {}
    for step in range(args.steps):
        ids = shard(global_batch(args, ctx.world_size, step), ctx)
        for name, model in models.items():
            barrier(ctx)
            with measure.CollectiveCounter() as comm:
                loss = model(ids)
                loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            losses[name].append(loss.item())
            if step == WARMUP:
                counted[name] = comm.by_kind
    out = dict(part="fsdp1", rank=ctx.rank, world_size=ctx.world_size, model=args.model,
               layers=args.layers, losses=mean_over_ranks(losses, ctx),
               fsdp1_warnings=sorted(set(caught)), results={})
    for name in models:
        want = wire_payload(fsdp_communication(spec, ctx.world_size,
                                           reshard_after_forward=name != "shard_grad_op"))
        got = counted[name]
        out["results"][name] = dict(
            collectives={op: {"calls": c, "bytes": b} for op, (c, b) in got.items()},
            predicted_collectives={op: {"calls": c, "bytes": b} for op, (c, b) in want.items()},
            ratio_collectives={op: got.get(op, (0, 0))[1] / b for op, (_, b) in want.items()})
    if ctx.rank == 0:
        ref, _ = reference(base, args, ctx.world_size)
        out["reference_losses"] = ref
        out["loss_max_diff"] = {k: max(abs(a - b) for a, b in zip(v, ref))
                                for k, v in out["losses"].items()}
    return out


def print_fsdp1(r: dict) -> None:
    print(f"transformers {r['model']}, {r['layers']} blocks, {r['world_size']} ranks: FSDP1 "
          "(FullyShardedDataParallel, use_orig_params) beside FSDP2 (fully_shard)")
    for name, s in r["results"].items():
        issued = ", ".join(f"{op} {c['calls']}x {c['bytes']:,}" for op, c in
                           s["collectives"].items())
        ratios = "/".join(f"{v:.3f}" for v in s["ratio_collectives"].values())
        diff = r.get("loss_max_diff", {}).get(name, float("nan"))
        print(f"  {name:<14}{issued:<60} S ratio {ratios:<12} loss diff {diff:.1e}")
    for w in r["fsdp1_warnings"]:
        print(f"  (building FSDP1, torch warned: {w[:160]})")
