"""--part ppdp (4 ranks, pp2 x dp2) and --part 3d (8 ranks, pp2 x dp2 x tp2) of
labkit.labs.threed: pipeline x data (x tensor) parallelism on a transformers Llama.

labkit.parallel.mesh: Degrees(pp=2, dp=2[, tp=2]).build_mesh(); the model is cut into 2 stages
(labkit.parallel.pipe.split_model), each rank keeps its stage (mesh["pp"].get_local_rank())
and `parallelize`s it with the same mesh: TP on mesh["tp"] inside the stage (3d), FSDP2 over
mesh["dp"] (plain DDP works under torch's schedules, module 07 measured it, but
static_graph=True lets the replicas drift silently; FSDP2 is the data axis here, as in torchtitan).
torch.distributed.pipelining's Schedule1F1B runs --microbatches micro-batches over the pp
group; each replica (dp index) takes its half of the global batch. --steps AdamW steps.
Reported:
- loss per step (the last stage's, mean over its micro-batches and the replicas) beside one
  process training on the whole global batch;
- model states of this rank (measure.state_bytes) after the first step, beside
  estimate_memory(pp=2, dp=2, tp=.., zero_stage=3, precision="fp32") scaled to this rank's stage
  (labkit.memory.stage_params: states are proportional to the stage's parameters under ZeRO-3;
  with tp the embedding on stage 0 and the head on stage 1 are split over the vocabulary, as
  the formula assumes);
- every rank's stage gathered whole after the last step: its checksum (sum |x|) and largest
  difference from one process's parameters; the replicas (every rank of a stage) must agree;
- the last step's collectives per mesh axis: send/recv on pp, FSDP2's on dp, TP's on tp.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from labkit.labs import _3d_common as common


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
    return {c: getattr(est, c) * scale for c in common.CATEGORIES}


def run_pp(args, ctx) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from labkit.labs import _pp_common as ppc
    from labkit.parallel.mesh import parallelize
    from labkit.parallel.pipe import causal_lm_loss, split_model

    deg = degrees(args.part, ctx.world_size)
    mesh = deg.build_mesh(ctx.device.type)
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    base, spec = ppc.build(args)
    batches = [ppc.batch(args, replicas=2, step=s) for s in range(args.steps)]
    ref_losses, ref_model = common.reference_run(base, batches, args.lr)
    model = copy.deepcopy(base)
    module = split_model(model, 2)[pp]
    names = common.stage_names(model, module)
    parallelize(module, mesh)
    stage = PipelineStage(module, pp, 2, ctx.device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=causal_lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    losses, axes, states, times = [], {}, {}, []
    for step, ids in enumerate(batches):
        mine = ids.chunk(2)[dp].to(ctx.device)
        out: list = []
        t = time.perf_counter()
        with common.AxisCounter() as counter:
            schedule.step(*((mine,) if pp == 0 else ()), target=mine if pp == 1 else None,
                          losses=out)
        opt.step()
        axes = counter.by_axis(mesh)                    # the last step's (shapes known)
        if step == 0:
            states = common.states_beside(module, opt, predicted_states(spec, args, deg, pp))
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(torch.stack(out).mean().item() if out else None)
    rows = ppc.gather(dict(pp=pp, losses=losses, **common.parity(module, names, ref_model)))
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
    common.print_states(r["states"], f"estimate_memory, stage {r['stage']}")
    print(f"  stage checksums per rank {', '.join(f'{c:.4f}' for c in r['checksums'])}; "
          f"replicas differ by {r['replica_checksum_diff']:.1e}; largest |param - one "
          f"process's| {r['max_param_diff']:.1e}")
    by_axis = {a: {k: c for k, (c, _) in kinds.items()} for a, kinds in r["collectives"].items()}
    print(f"  collectives of one step on rank 0, per axis (calls): {by_axis}")
