"""--part dtensor of labkit.labs.tp: torch's DTensor tensor parallelism on a transformers Llama.

    labkit run tp -n 2 -- --part dtensor                 # parallelize_module on a Llama

labkit.labs.tp.lab calls run_dtensor(args, ctx) and print_dtensor: `parallelize_module` with a
plan per decoder layer (`PLANS`, `layer_plan`), each layer's collectives (`LayerWindows`) beside
the plan's count (`plan_counts`) and Megatron's (labkit.comm.step_communication("tp", ...)).
What each plan sends and why: docs/labs.md, ## tp.
"""
from __future__ import annotations

import copy
import math
import time

import torch

from labkit.runtime import measure

PLANS = ("plain", "fused", "sp")
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def build_llama(args, device):
    """(transformers LlamaForCausalLM from config, ModelSpec): debug-llama at the flags' sizes,
    fp32, SDPA attention, seeded (the same weights on every rank)."""
    from labkit.labs.common.models import build_model
    from labkit.models import get_model

    spec = get_model("debug-llama").with_(
        name="lab-llama", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.kv_heads, ffn_size=2 * args.hidden, vocab_size=args.vocab,
        max_seq_len=max(args.seq, 64))
    torch.manual_seed(args.seed)
    return build_model(spec, None, torch.float32, "sdpa").to(device).train(), spec


def layer_plan(plan: str) -> dict:
    """The parallelize_module plan of one LlamaDecoderLayer: "plain" (column q, k, v, gate, up;
    row o, down: the backward all-reduces each column layer's input gradient separately), or
    labkit.parallel.mesh.llama_plan ("fused": each sub-block's input made replicated once;
    "sp": the same with the norms on sequence shards)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from labkit.parallel.mesh import llama_plan

    if plan != "plain":
        return llama_plan(sequence_parallel=plan == "sp")
    out = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    out.update({f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")})
    out["self_attn.o_proj"] = RowwiseParallel()
    out["mlp.down_proj"] = RowwiseParallel()
    return out


def root_plan() -> dict:
    """Sequence parallelism outside the layers: vocab-parallel embedding with a sequence-sharded
    output, the final norm on the shard, the head's input gathered (the head stays whole)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                  output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=True)}


def parallelize(lm, plan: str, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    for block in lm.model.layers:
        parallelize_module(block, mesh, layer_plan(plan))
    if plan == "sp":
        parallelize_module(lm, mesh, root_plan())
    return lm


def plan_counts(plan: str) -> dict:
    """{"forward"|"backward": {kind: calls}} per layer, read from the layer's plan: each
    RowwiseParallel reduces its output (all-reduce, or reduce-scatter with sequence parallelism)
    and its backward gathers (sp); each conversion of a plain input to a replicated DTensor
    (every ColwiseParallel in "plain", each PrepareModuleInput otherwise) all-reduces its
    gradient in the backward, or, from a sequence shard, all-gathers forward / reduce-scatters
    backward."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel)

    styles = list(layer_plan(plan).values())
    rows = sum(isinstance(s, RowwiseParallel) for s in styles)
    entries = sum(isinstance(s, PrepareModuleInput if plan != "plain" else ColwiseParallel)
                  for s in styles)
    if plan == "sp":
        return {"forward": {"all_gather": entries, "reduce_scatter": rows},
                "backward": {"all_gather": rows, "reduce_scatter": entries}}
    return {"forward": {"all_reduce": rows}, "backward": {"all_reduce": entries}}


class LayerWindows:
    """Which collectives each decoder layer issues, forward and backward. A forward pre-hook
    and a forward hook mark the layer's forward; a gradient hook on its output marks where its
    backward begins and one on its input where it ends (the input's gradient is complete once
    the block and the residual have both contributed)."""

    def __init__(self, layers, counter: measure.CollectiveCounter):
        self.counter, self.marks, self.handles = counter, {}, []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(i), with_kwargs=True))

    def _mark(self, key):
        self.marks[key] = len(self.counter.events)

    def _pre(self, i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self._mark(("forward", i, 0))
            if x.requires_grad:
                x.register_hook(lambda g: self._mark(("backward", i, 1)))
        return hook

    def _post(self, i):
        def hook(module, args, kwargs, out):
            self._mark(("forward", i, 1))
            y = out[0] if isinstance(out, tuple) else out
            y.register_hook(lambda g: self._mark(("backward", i, 0)))
        return hook

    def by_layer(self, layers: int) -> list:
        """[{"forward"|"backward": {kind: [calls, bytes]}}] per layer."""
        out = []
        for i in range(layers):
            row = {}
            for phase in ("forward", "backward"):
                lo, hi = self.marks[(phase, i, 0)], self.marks[(phase, i, 1)]
                row[phase] = tally(self.counter.events[lo:hi])
            out.append(row)
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def tally(events) -> dict:
    out: dict = {}
    for e in events:
        c = out.setdefault(e.kind, [0, 0])
        c[0] += 1
        c[1] += e.bytes
    return out


def run_dtensor(args, ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.comm import step_communication
    from labkit.labs.common.training import barrier, global_batch, median

    base, spec = build_llama(args, ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    pos = torch.arange(args.seq, device=ctx.device).unsqueeze(0)
    ref = copy.deepcopy(base) if ctx.rank == 0 else None
    out = dict(part="dtensor", rank=ctx.rank, world_size=ctx.world_size, layers=args.layers,
               hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, batch=args.batch,
               seq=args.seq, num_params=spec.num_params(), plans={})
    for plan in args.plan:
        lm = parallelize(copy.deepcopy(base), plan, mesh)
        opt = torch.optim.AdamW(lm.parameters(), lr=args.lr)
        losses, counted, times = [], {}, []
        for step in range(args.steps):
            ids = global_batch(args, 1, step).to(ctx.device)    # every tp rank: the whole batch
            counter = measure.CollectiveCounter()
            windows = LayerWindows(lm.model.layers, counter)
            barrier(ctx)
            t = time.perf_counter()
            with counter:
                loss = lm(input_ids=ids, position_ids=pos, labels=ids).loss
                loss.backward()
                before_opt = len(counter.events)
                opt.step()
            windows.close()
            opt.zero_grad()
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
            if step == 0:
                counted = dict(layers=windows.by_layer(args.layers),
                               step=tally(counter.events[:before_opt]),
                               optimizer=tally(counter.events[before_opt:]))
        out["plans"][plan] = dict(losses=losses, **counted, step_s=median(times[1:]),
                                  predicted_per_layer=plan_counts(plan))
        sp = plan == "sp"
        comm = step_communication("tp", model=spec, tp=ctx.world_size, batch_size=args.batch,
                                  seq_len=args.seq, sequence_parallel=sp, activation_bytes=4)
        predicted = {op: {"calls": c, "bytes": b} for op, (c, b) in comm.payload.items()}
        layer_sum = tally([])
        for row in counted["layers"]:
            for phase in row.values():
                for kind, (c, b) in phase.items():
                    layer_sum.setdefault(kind, [0, 0])
                    layer_sum[kind][0] += c
                    layer_sum[kind][1] += b
        out["plans"][plan].update(
            layer_total=layer_sum, predicted_megatron=predicted,
            ratio_bytes={k: layer_sum.get(k, [0, 0])[1] / v["bytes"]
                         for k, v in predicted.items()})
    if ref is not None:
        opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
        ref_losses = []
        for step in range(args.steps):
            ids = global_batch(args, 1, step).to(ctx.device)
            loss = ref(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        out["reference_losses"] = ref_losses
        out["loss_max_diff"] = {p: max(abs(a - b) for a, b in zip(r["losses"], ref_losses))
                                for p, r in out["plans"].items()}
    return out


def print_dtensor(r: dict) -> None:
    print(f"transformers Llama from config: {r['layers']} layers, h {r['hidden']}, "
          f"{r['heads']} heads ({r['kv_heads']} kv), {r['num_params']:,} parameters; "
          f"tp {r['world_size']}, batch {r['batch']} x {r['seq']} tokens (every rank)")
    for plan, p in r["plans"].items():
        layer0 = p["layers"][0]
        got = "; ".join(f"{ph} " + ", ".join(f"{k} {c}" for k, (c, _) in layer0[ph].items())
                        for ph in ("forward", "backward"))
        want = "; ".join(f"{ph} " + ", ".join(f"{k} {c}" for k, c in
                                              p["predicted_per_layer"][ph].items())
                         for ph in ("forward", "backward"))
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in p["ratio_bytes"].items())
        diff = r.get("loss_max_diff", {}).get(plan, math.nan)
        print(f"  {plan:<6} per layer: {got}  (plan implies: {want})")
        print(f"         bytes of the layers / step_communication('tp'): {ratios}; "
              f"loss diff vs 1 process {diff:.1e}")
        if p["optimizer"]:
            opt = ", ".join(f"{k} {c}x ({b:,} B)" for k, (c, b) in p["optimizer"].items())
            print(f"         optimizer step: {opt} (the norms' Partial gradients)")
