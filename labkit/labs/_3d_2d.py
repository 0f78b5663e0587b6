"""--part 2d of labkit.labs.threed: TP + FSDP2 on a transformers Llama, 4 ranks (dp2 x tp2).

labkit.parallel.mesh: Degrees(dp=2, tp=2).build_mesh(), then `parallelize(model, mesh)`: TP on
mesh["tp"] (each decoder layer: column-parallel q, k, v, gate, up, row-parallel o, down, the
attention's and MLP's input made replicated once), then FSDP2 over mesh["dp"] (per layer, then
the root). The two TP ranks of a replica see the same sequences; the two replicas each take half
of the global batch. --steps AdamW steps; reported:
- loss per step (mean over the replicas) beside one process training on the whole global batch;
- model states per rank (labkit.runtime.measure.state_bytes, local DTensor shards) after the
  first step, beside estimate_memory(tp=2, dp=2, zero_stage=3, precision="fp32"), which splits
  the layers' matrices and the embedding and head over tp (Megatron's vocab-parallel layers)
  and everything over dp: exact (ratio 1.000);
- the first step's collectives per mesh axis (labkit.labs._3d_common.AxisCounter), beside
  step_communication("tp") (Megatron's 4 all-reduces per layer, b s h x 4 bytes) plus the
  vocab-parallel embedding's and head's (_3d_common.vocab_collectives: 2 all-reduces of b s h
  and the logits' all-gather), and step_communication("fsdp", dp=2, tp=2) (an all-gather per
  layer forward and backward and for the root once, a reduce-scatter per unit): exact.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from labkit.labs import _3d_common as common


def run_2d(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.labs import _pp_common as ppc
    from labkit.labs.ddp import global_batch
    from labkit.memory import estimate_memory
    from labkit.parallel.mesh import Degrees, parallelize
    from labkit.parallel.pipe import causal_lm_loss

    deg = Degrees(dp=2, tp=2)
    deg.check(world=ctx.world_size)
    mesh = deg.build_mesh(ctx.device.type)
    base, spec = ppc.build(args)
    batches = [global_batch(args, 2, step) for step in range(args.steps)]
    ref_losses, _ = common.reference_run(base, batches, args.lr)
    model = parallelize(copy.deepcopy(base), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp = mesh["dp"].get_local_rank()
    losses, axes, states, times = [], {}, {}, []
    for step, ids in enumerate(batches):
        mine = ids.chunk(2)[dp].to(ctx.device)
        t = time.perf_counter()
        with common.AxisCounter() as counter:
            loss = causal_lm_loss(model(mine).logits, mine)
            loss.backward()
        opt.step()
        if step == 0:
            axes = counter.by_axis(mesh)
            est = estimate_memory(spec, batch_size=args.batch, seq_len=args.seq, tp=2, dp=2,
                                  zero_stage=3, precision="fp32", optimizer="adamw")
            states = common.states_beside(model, opt, est)
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(common.mean_over(loss.item(), mesh["dp"]))
    b = args.batch
    tp_comm = step_communication("tp", model=spec, tp=2, batch_size=b, seq_len=args.seq,
                                 activation_bytes=4).payload
    fsdp_comm = step_communication("fsdp", model=spec, dp=2, tp=2, param_bytes=4,
                                   grad_bytes=4).payload
    predicted = {"tp": common.merged(tp_comm, common.vocab_collectives(spec, b, args.seq)),
                 "dp": {k: list(v) for k, v in fsdp_comm.items()}}
    return dict(part="2d", rank=ctx.rank, world_size=ctx.world_size, degrees=str(deg),
                coords=deg.coords(ctx.rank), num_params=spec.num_params(), layers=args.layers,
                batch=b, seq=args.seq, losses=losses, reference_losses=ref_losses,
                step_s=statistics.median(times[1:] or times),
                loss_max_diff=max(abs(a - c) for a, c in zip(losses, ref_losses)),
                states=states, collectives=axes, predicted_collectives=predicted,
                ratio_calls=common.ratios(axes, predicted, 0),
                ratio_bytes=common.ratios(axes, predicted, 1))


def print_2d(r: dict) -> None:
    print(f"{r['degrees']}: TP then FSDP2 on a {r['num_params']:,}-parameter Llama "
          f"({r['layers']} layers), {r['batch']} x {r['seq']} tokens per replica")
    print("  loss " + ", ".join(f"{x:.6f}" for x in r["losses"]) + "  one process "
          + ", ".join(f"{x:.6f}" for x in r["reference_losses"])
          + f"  (max diff {r['loss_max_diff']:.1e})")
    common.print_states(r["states"], "estimate_memory(tp=2, dp=2, zero_stage=3)")
    common.print_axes(r)
