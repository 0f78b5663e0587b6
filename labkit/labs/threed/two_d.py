"""--part 2d of labkit.labs.threed: TP + FSDP2 on a transformers Llama, 4 ranks (dp2 x tp2).

    labkit run threed -n 4 -- --part 2d         # TP + FSDP2 on a transformers Llama

labkit.labs.threed.lab calls run_2d(args, ctx) and print_2d: labkit.parallel.mesh's
Degrees(dp=2, tp=2).build_mesh() and `parallelize(model, mesh)`, trained beside one process;
model states beside estimate_memory(tp=2, dp=2, zero_stage=3, precision="fp32"), collectives per
axis beside step_communication("tp") and ("fsdp", dp=2, tp=2). Details: docs/labs.md, ## threed.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from labkit.labs.threed import shared
from labkit.runtime import noise


def run_2d(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.labs.common import pipeline as ppc
    from labkit.labs.common.training import global_batch
    from labkit.memory import estimate_memory
    from labkit.parallel.mesh import Degrees, parallelize
    from labkit.parallel.pipe import causal_lm_loss

    deg = Degrees(dp=2, tp=2)
    deg.check(world=ctx.world_size)
    mesh = deg.build_mesh(ctx.device.type)
    base, spec = ppc.build(args)
    batches = [global_batch(args, 2, step) for step in range(args.steps)]
    ref_losses, _ = shared.reference_run(base, batches, args.lr)
    model = parallelize(copy.deepcopy(base), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp = mesh["dp"].get_local_rank()
    losses, axes, states, times = [], {}, {}, []
    for step, ids in enumerate(batches):
        mine = ids.chunk(2)[dp].to(ctx.device)
        t = time.perf_counter()
        with shared.AxisCounter() as counter:
            with noise.ignoring(noise.FSDP2_VIEW):       # the logits are a view, used out of place
                logits = model(mine).logits
            loss = causal_lm_loss(logits, mine)
            loss.backward()
        opt.step()
        if step == 0:
            axes = counter.by_axis(mesh)
            est = estimate_memory(spec, batch_size=args.batch, seq_len=args.seq, tp=2, dp=2,
                                  zero_stage=3, precision="fp32", optimizer="adamw")
            states = shared.states_beside(model, opt, est)
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(shared.mean_over(loss.item(), mesh["dp"]))
    b = args.batch
    tp_comm = step_communication("tp", model=spec, tp=2, batch_size=b, seq_len=args.seq,
                                 activation_bytes=4).payload
    fsdp_comm = step_communication("fsdp", model=spec, dp=2, tp=2, param_bytes=4,
                                   grad_bytes=4).payload
    predicted = {"tp": shared.merged(tp_comm, shared.vocab_collectives(spec, b, args.seq)),
                 "dp": {k: list(v) for k, v in fsdp_comm.items()}}
    return dict(part="2d", rank=ctx.rank, world_size=ctx.world_size, degrees=str(deg),
                coords=deg.coords(ctx.rank), num_params=spec.num_params(), layers=args.layers,
                batch=b, seq=args.seq, losses=losses, reference_losses=ref_losses,
                step_s=statistics.median(times[1:] or times),
                loss_max_diff=max(abs(a - c) for a, c in zip(losses, ref_losses)),
                states=states, collectives=axes, predicted_collectives=predicted,
                ratio_calls=shared.ratios(axes, predicted, 0),
                ratio_bytes=shared.ratios(axes, predicted, 1))


def print_2d(r: dict) -> None:
    print(f"{r['degrees']}: TP then FSDP2 on a {r['num_params']:,}-parameter Llama "
          f"({r['layers']} layers), {r['batch']} x {r['seq']} tokens per replica")
    print("  loss " + ", ".join(f"{x:.6f}" for x in r["losses"]) + "  one process "
          + ", ".join(f"{x:.6f}" for x in r["reference_losses"])
          + f"  (max diff {r['loss_max_diff']:.1e})")
    shared.print_states(r["states"], "estimate_memory(tp=2, dp=2, zero_stage=3)")
    shared.print_axes(r)
