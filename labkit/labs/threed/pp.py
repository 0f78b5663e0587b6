"""--part ppdp (4 ranks, pp2 x dp2) and --part 3d (8 ranks, pp2 x dp2 x tp2) of
labkit.labs.threed: pipeline x data (x tensor) parallelism on a transformers Llama.

    labkit run threed -n 4 -- --part ppdp       # pipeline x FSDP2 (pp2 x dp2)
    labkit run threed -n 8 -- --part 3d         # pp2 x dp2 x tp2

labkit.labs.threed.lab calls run_pp(args, ctx) and print_pp: Schedule1F1B over mesh["pp"], each
stage `parallelize`d with the same mesh (TP on mesh["tp"] inside it, FSDP2 over mesh["dp"], as
in torchtitan). What is reported, beside estimate_memory(pp=2, ...): docs/labs.md, ## threed.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from labkit.labs.threed import shared
from labkit.runtime import noise


def degrees(part: str, world: int):
    from labkit.parallel.mesh import Degrees

    return Degrees(pp=2, dp=2, tp=2 if part == "3d" else 1).check(world=world)


def predicted_states(spec, args, deg, stage: int) -> dict:
    """estimate_memory's model states for the worst stage, scaled to `stage` by its share of
    parameters (labkit.memory.stage_params)."""
    from labkit.memory import estimate_memory, stage_params

    est = estimate_memory(spec, batch_size=args.micro_batch, seq_len=args.seq, precision="fp32",
                          optimizer="adamw", zero_stage=3, dp=deg.dp, tp=deg.tp, pp=deg.pp,
                          microbatches=args.microbatches)
    share = stage_params(spec, deg.tp, deg.pp)
    scale = share[stage] / share[est.stage]
    return {c: getattr(est, c) * scale for c in shared.CATEGORIES}


def run_pp(args, ctx) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from labkit.labs.common import pipeline as ppc
    from labkit.parallel.mesh import parallelize
    from labkit.parallel.pipe import causal_lm_loss, split_model

    deg = degrees(args.part, ctx.world_size)
    mesh = deg.build_mesh(ctx.device.type)
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    base, spec = ppc.build(args)
    batches = [ppc.batch(args, replicas=2, step=s) for s in range(args.steps)]
    ref_losses, ref_model = shared.reference_run(base, batches, args.lr)
    model = copy.deepcopy(base)
    module = split_model(model, 2)[pp]
    names = shared.stage_names(model, module)
    parallelize(module, mesh)
    stage = PipelineStage(module, pp, 2, ctx.device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=causal_lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    losses, axes, states, times = [], {}, {}, []
    for step, ids in enumerate(batches):
        mine = ids.chunk(2)[dp].to(ctx.device)
        out: list = []
        t = time.perf_counter()
        with (shared.AxisCounter() as counter,
              noise.ignoring(noise.PAST_KEY_VALUES, noise.FSDP2_VIEW)):     # a stage's logits
            schedule.step(*((mine,) if pp == 0 else ()), target=mine if pp == 1 else None,
                          losses=out)
        opt.step()
        axes = counter.by_axis(mesh)                    # the last step's (shapes known)
        if step == 0:
            states = shared.states_beside(module, opt, predicted_states(spec, args, deg, pp))
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(torch.stack(out).mean().item() if out else None)
    rows = ppc.gather(dict(pp=pp, losses=losses, **shared.parity(module, names, ref_model)))
    last = [r["losses"] for r in rows if r["pp"] == 1]
    mean = [sum(x[s] for x in last) / len(last) for s in range(args.steps)]
    sums = {s: [r["checksum"] for r in rows if r["pp"] == s] for s in (0, 1)}
    return dict(part=args.part, rank=ctx.rank, world_size=ctx.world_size, degrees=str(deg),
                coords=deg.coords(ctx.rank), stage=pp, num_params=spec.num_params(),
                layers=args.layers, microbatches=args.microbatches, micro_batch=args.micro_batch,
                seq=args.seq, losses=mean, reference_losses=ref_losses,
                step_s=statistics.median(times[1:] or times),
                loss_max_diff=max(abs(a - b) for a, b in zip(mean, ref_losses)),
                states=states, collectives=axes, checksums=[r["checksum"] for r in rows],
                reference_checksums=[r["reference_checksum"] for r in rows],
                replica_checksum_diff=max(max(v) - min(v) for v in sums.values()),
                max_param_diff=max(r["max_param_diff"] for r in rows))


def print_pp(r: dict) -> None:
    tp = ", TP inside each stage" if "tp2" in r["degrees"] else ""
    print(f"{r['degrees']}: 1F1B over pp, FSDP2 over dp{tp}; "
          f"{r['num_params']:,}-parameter Llama, {r['layers']} layers, {r['microbatches']} "
          f"micro-batches of {r['micro_batch']} x {r['seq']} tokens per replica")
    print("  loss " + ", ".join(f"{x:.6f}" for x in r["losses"]) + "  one process "
          + ", ".join(f"{x:.6f}" for x in r["reference_losses"])
          + f"  (max diff {r['loss_max_diff']:.1e})")
    shared.print_states(r["states"], f"estimate_memory, stage {r['stage']}")
    print(f"  stage checksums per rank {', '.join(f'{c:.4f}' for c in r['checksums'])}; "
          f"replicas differ by {r['replica_checksum_diff']:.1e}; largest |param - one "
          f"process's| {r['max_param_diff']:.1e}")
    by_axis = {a: {k: c for k, (c, _) in kinds.items()} for a, kinds in r["collectives"].items()}
    print(f"  collectives of one step on rank 0, per axis (calls): {by_axis}")
