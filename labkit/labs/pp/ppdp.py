"""--part ppdp of labkit.labs.pp: pipeline x data parallelism on 4 ranks, pp 2 x dp 2.

    labkit run pp -n 4 -- --part ppdp                    # pp 2 x dp 2: DDP, FSDP2 on the dp axis

labkit.labs.pp.lab calls run_ppdp(args, ctx) and print_ppdp: Schedule1F1B with the stage wrapped
for the data axis three ways (VARIANTS: "ddp", "ddp static_graph", "fsdp2"), beside one process
and step_communication("ddp", pp=2). What it shows on torch 2.13 (static_graph's replicas drift
apart silently): docs/labs.md, ## pp.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as tdist

from labkit.labs.common import pipeline as shared
from labkit.runtime import measure, noise

VARIANTS = ("ddp", "ddp static_graph", "fsdp2")
REDUCTIONS = ("all_reduce", "reduce_scatter", "all_gather")


def wrap(variant: str, module, mesh):
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        return fully_shard(module, mesh=mesh["dp"])
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(module, process_group=mesh["dp"].get_group(),
                                   static_graph=variant.endswith("static_graph"))


def checksum(module) -> float:
    """Sum of |x| over the module's parameters, DTensors gathered whole (a collective over
    the dp group for FSDP2: every dp rank calls it)."""
    total = 0.0
    for p in module.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        total += t.detach().double().abs().sum().item()
    return total


def reference_losses(base, args, steps: int) -> list[float]:
    """One process, the whole global batch, the same SGD steps."""
    from labkit.parallel.pipe import causal_lm_loss

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    out = []
    for step in range(steps):
        ids = shared.batch(args, replicas=2, step=step)
        loss = causal_lm_loss(model(ids).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def run_variant(variant, base, mesh, args, ctx) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from labkit.parallel.pipe import causal_lm_loss, split_model

    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = copy.deepcopy(base)
    module = wrap(variant, split_model(model, 2)[pp], mesh)
    stage = PipelineStage(module, pp, 2, ctx.device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=causal_lm_loss)
    opt = torch.optim.SGD(module.parameters(), lr=args.lr)
    rows, error, counted = [], None, {}
    for step in range(args.steps):
        ids = shared.batch(args, replicas=2, step=step).chunk(2)[dp]
        losses: list = []
        try:
            with measure.CollectiveCounter() as counter, noise.ignoring(noise.PAST_KEY_VALUES):
                schedule.step(*((ids,) if pp == 0 else ()), target=ids if pp == 1 else None,
                              losses=losses)
            failed = 0.0
        except Exception as exc:                     # noqa: BLE001 - shown to the learner
            error, failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}", 1.0
        if shared.all_max(failed):                  # one rank failed: every rank stops here
            break
        opt.step()
        opt.zero_grad()
        counted = {k: list(v) for k, v in counter.by_kind.items() if k in REDUCTIONS}
        loss = torch.stack(losses).mean().item() if losses else None
        rows.append(dict(loss=loss, checksum=checksum(module)))
    errors = [e for e in shared.gather(error) if e]
    everything = shared.gather(rows)              # [rank][step]
    steps = min(len(r) for r in everything)
    losses = [sum(everything[r][s]["loss"] for r in (2, 3)) / 2 for s in range(steps)]
    drift = [max(abs(everything[a][s]["checksum"] - everything[b][s]["checksum"])
                 for a, b in ((0, 1), (2, 3))) for s in range(steps)]
    return dict(error=errors[0] if errors else None, failed_ranks=len(errors),
                steps_done=steps, loss=losses, replica_checksum_diff=drift,
                replicas_agree=bool(steps) and max(drift) < 1e-6,
                reductions=shared.gather(counted))


def run_ppdp(args, ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("pp", "dp"))
    base, _ = shared.build(args)
    ref = reference_losses(base, args, args.steps)
    rows = {}
    for variant in VARIANTS:
        row = run_variant(variant, base, mesh, args, ctx)
        row["loss_diff"] = [abs(a - b) for a, b in zip(row["loss"], ref)]
        rows[variant] = row
        tdist.barrier()
    from labkit.comm import step_communication

    ddp = step_communication("ddp", model=shared.spec_of(args), pp=2, dp=2,
                             grad_bytes=4).payload["all_reduce"]
    return dict(part="ppdp", rank=ctx.rank, world_size=ctx.world_size, pp=2, dp=2,
                microbatches=args.microbatches, steps=args.steps, reference_loss=ref,
                variants=rows, predicted_ddp_all_reduce=list(ddp),
                reductions_if_every_microbatch=args.microbatches)


def print_ppdp(r: dict) -> None:
    print(f"pp 2 x dp 2, Schedule1F1B, m={r['microbatches']}, {r['steps']} SGD steps; one "
          f"process: loss {', '.join(f'{x:.6f}' for x in r['reference_loss'])}")
    for name, row in r["variants"].items():
        diff = max(row["loss_diff"], default=float("nan"))
        drift = max(row["replica_checksum_diff"], default=float("nan"))
        red = [sum(c for k, (c, _) in counted.items() if k != "all_gather")
               for counted in row["reductions"]]
        print(f"  {name:<18} steps {row['steps_done']}/{r['steps']}  |loss diff| {diff:.1e}  "
              f"replica checksum diff {drift:.1e}  gradient reductions in a step, per rank "
              f"{red}")
        if row["error"]:
            print(f"    error: {row['error'][:150]}")
