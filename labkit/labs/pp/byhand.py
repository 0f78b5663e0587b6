"""--part byhand of labkit.labs.pp: GPipe and 1F1B by hand (labkit.parallel.pipe's gpipe_step and
one_f_one_b_step, send/recv between ranks) on a transformers Llama cut into one stage per rank.

    labkit run pp -n 4                                   # --part byhand: GPipe, 1F1B by hand
    labkit run pp -n 4 -- --trace traces/                # + a profiler trace per rank

labkit.labs.pp.lab calls run_byhand(args, ctx) and print_byhand; the measured step beside
labkit.pipeline.simulate: labkit.labs.common.pipeline. What is reported: docs/labs.md, ## pp.
"""
from __future__ import annotations

from labkit.labs.common import pipeline as shared
from labkit.labs.common.tracing import trace_steps
from labkit.runtime import noise

SCHEDULES = ("gpipe", "1f1b")


def run_byhand(args, ctx) -> dict:
    from labkit.parallel import pipe

    p, m, rank = ctx.world_size, args.microbatches, ctx.rank
    model, _ = shared.build(args)
    ids = shared.batch(args)
    ref_loss, ref_grads = shared.reference(model, ids)
    stage = shared.Slowed(pipe.split_model(model, p)[rank], args.sleep)
    micro = pipe.split_batch(ids, ids, m)
    steps = {"gpipe": pipe.gpipe_step, "1f1b": pipe.one_f_one_b_step}
    rows = {}

    def run(name, seconds=args.sleep):
        model.zero_grad(set_to_none=True)
        stage.sleep.weight.grad = None
        stage.sleep.seconds = seconds
        with noise.ignoring(noise.PAST_KEY_VALUES):
            return steps[name](stage, micro, rank=rank, world=p)
    for name in SCHEDULES:
        def step(seconds=args.sleep):
            loss, stats = run(name, seconds)        # noqa: B023
            return pipe.gather_events(stats), (loss, stats)

        step(0.0)                                       # a warm-up step, without sleep
        row, (loss, stats) = shared.least_disturbed_step(step, args.repeats, name, p, m)
        losses = [x for x in shared.gather(None if loss is None else loss.item())
                  if x is not None]
        row.update(loss=losses[0], loss_diff=abs(losses[0] - ref_loss),
                   grad_max_diff=shared.all_max(shared.grad_diff(model, [stage], ref_grads)),
                   peak_in_flight=shared.gather(stats["peak_in_flight"]),
                   p2p_sent=shared.gather(stats["p2p"]["sent"]))
        rows[name] = row
        row["trace"] = trace_steps(ctx, getattr(args, "trace", None), "pp", name,
                                   lambda: run(name), extra=dict(microbatches=m,
                                                                 sleep=args.sleep))
    return dict(part="byhand", rank=rank, world_size=p, microbatches=m, sleep=args.sleep,
                reference_loss=ref_loss, schedules=rows)


def print_byhand(r: dict) -> None:
    print(f"pipeline by hand: p={r['world_size']}, m={r['microbatches']}, sleep "
          f"{r['sleep']:g} s forward (2x backward); loss vs one process "
          f"{r['reference_loss']:.6f}")
    print_rows(r["schedules"])


def print_rows(rows: dict) -> None:
    """The table every part prints: per schedule, loss and largest gradient difference from
    one process, idle shares measured and simulated (their ratio, the closed form where there
    is one, the difference in points), the same order as the simulator's, peaks held measured
    / simulated."""
    print(f"  {'schedule':<18}{'|loss diff|':>12}{'|grad diff|':>12}{'idle meas':>10}{'sim':>7}"
          f"{'ratio':>7}{'formula':>8}{'diff pts':>9}  order  {'peak in flight (meas / sim)'}")
    for name, row in rows.items():
        peaks = " ".join(f"{a:g}/{b:g}" for a, b in zip(row["peak_in_flight"],
                                                        row["predicted_in_flight"]))
        form = "-" if row["idle_formula"] is None else f"{row['idle_formula']:.3f}"
        ratio = (row["idle_measured"] / row["idle_simulated"] if row["idle_simulated"] > 0
                 else float("nan"))
        print(f"  {name:<18}{row['loss_diff']:>12.1e}{row['grad_max_diff']:>12.1e}"
              f"{row['idle_measured']:>10.3f}{row['idle_simulated']:>7.3f}{ratio:>7.2f}{form:>8}"
              f"{row['difference_points']:>9.1f}  {'same ' if row['same_order'] else 'DIFF '}"
              f"  {peaks}")
