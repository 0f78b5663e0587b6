"""--part byhand of labkit.labs.pp: GPipe and 1F1B by hand (labkit.parallel.pipe's gpipe_step and
one_f_one_b_step, send/recv between ranks) on a transformers Llama cut into one stage per rank.

Per schedule, a warm-up step (no sleep), then --repeats measured steps; the shortest (the least
disturbed by other processes) is reported (labkit.labs._pp_common.least_disturbed_step):
- the loss (the last stage's, the batch mean) against one process on the whole batch, and the
  largest gradient difference of any parameter from that process's;
- the measured timeline (every rank's F and B with their times on a clock the ranks agree on)
  beside labkit.pipeline.simulate at the measured op costs (labkit.labs._pp_common.beside):
  idle share measured vs simulated, difference in points, the same order on every stage;
- the micro-batches each stage held at once, measured (stats["peak_in_flight"]) against the
  simulator's: GPipe m on every stage, 1F1B p - r on stage r.
"""
from __future__ import annotations

from labkit.labs import _pp_common as common

SCHEDULES = ("gpipe", "1f1b")


def run_byhand(args, ctx) -> dict:
    from labkit.parallel import pipe

    p, m, rank = ctx.world_size, args.microbatches, ctx.rank
    model, _ = common.build(args)
    ids = common.batch(args)
    ref_loss, ref_grads = common.reference(model, ids)
    stage = common.Slowed(pipe.split_model(model, p)[rank], args.sleep)
    micro = pipe.split_batch(ids, ids, m)
    steps = {"gpipe": pipe.gpipe_step, "1f1b": pipe.one_f_one_b_step}
    rows = {}
    for name in SCHEDULES:
        def step(seconds=args.sleep):
            model.zero_grad(set_to_none=True)
            stage.sleep.weight.grad = None
            stage.sleep.seconds = seconds
            loss, stats = steps[name](stage, micro, rank=rank, world=p)
            return pipe.gather_events(stats), (loss, stats)

        step(0.0)                                       # a warm-up step, without sleep
        row, (loss, stats) = common.least_disturbed_step(step, args.repeats, name, p, m)
        losses = [x for x in common.gather(None if loss is None else loss.item())
                  if x is not None]
        row.update(loss=losses[0], loss_diff=abs(losses[0] - ref_loss),
                   grad_max_diff=common.all_max(common.grad_diff(model, [stage], ref_grads)),
                   peak_in_flight=common.gather(stats["peak_in_flight"]),
                   p2p_sent=common.gather(stats["p2p"]["sent"]))
        rows[name] = row
    return dict(part="byhand", rank=rank, world_size=p, microbatches=m, sleep=args.sleep,
                reference_loss=ref_loss, schedules=rows)


def print_byhand(r: dict) -> None:
    print(f"pipeline by hand: p={r['world_size']}, m={r['microbatches']}, sleep "
          f"{r['sleep']:g} s forward (2x backward); loss vs one process "
          f"{r['reference_loss']:.6f}")
    print_rows(r["schedules"])


def print_rows(rows: dict) -> None:
    """The table every part prints: per schedule, loss difference, idle shares, peaks."""
    print(f"  {'schedule':<18}{'|loss diff|':>12}{'idle meas':>10}{'sim':>7}{'formula':>8}"
          f"{'diff pts':>9}  order  {'peak in flight (meas / sim)'}")
    for name, row in rows.items():
        peaks = " ".join(f"{a:g}/{b:g}" for a, b in zip(row["peak_in_flight"],
                                                        row["predicted_in_flight"]))
        print(f"  {name:<18}{row['loss_diff']:>12.1e}{row['idle_measured']:>10.3f}"
              f"{row['idle_simulated']:>7.3f}{row['idle_formula']:>8.3f}"
              f"{row['difference_points']:>9.1f}  {'same ' if row['same_order'] else 'DIFF '}"
              f"  {peaks}")

