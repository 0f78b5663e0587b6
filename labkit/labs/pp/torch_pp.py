"""--part torch of labkit.labs.pp: torch.distributed.pipelining's schedules on manual
PipelineStages cut from the same transformers Llama (labkit.parallel.pipe.split_model), measured.

    labkit run pp -n 4 -- --part torch                   # torch's schedules, measured

labkit.labs.pp.lab calls run_torch(args, ctx) and print_torch; `StageClock` times each stage's
ops. Schedules: SCHEDULES (ZB-H1, Qi et al. 2024, as labkit.pipeline's "zero-bubble"); how each
is measured and what is reported: docs/labs.md, ## pp.
"""
from __future__ import annotations

import copy
import time

import torch

from labkit.labs.common import pipeline as shared
from labkit.runtime import measure, noise

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
           "interleaved-1f1b": "ScheduleInterleaved1F1B",
           "zero-bubble": "ScheduleInterleavedZeroBubble"}


class StageClock:
    """Times the compute of this rank's PipelineStages: events as the simulator's (how they are
    timed: docs/labs.md, ## pp), and the most micro-batches held at once."""

    WRAPPED = {"forward_one_chunk": "F", "backward_one_chunk": "B",
               "backward_weight_one_chunk": "W"}

    def __init__(self, stages, rank: int, p: int):
        self.stages, self.rank, self.p = stages, rank, p
        self.events: list[dict] = []
        self.t0 = time.perf_counter()
        self.held = self.peak = 0
        for stage in stages:
            for name, kind in self.WRAPPED.items():
                setattr(stage, name, self._wrap(stage, getattr(stage, name), kind))

    def _wrap(self, stage, method, kind):
        def call(mb, *args, **kwargs):
            start = time.perf_counter()
            out = method(mb, *args, **kwargs)
            end = time.perf_counter()
            self.events.append({"stage": self.rank, "kind": kind, "microbatch": int(mb),
                                "chunk": stage.stage_index // self.p,
                                "start": start - self.t0, "end": end - self.t0})
            self.held = sum(len(s.fwd_cache) for s in self.stages)
            self.peak = max(self.peak, self.held)
            return out
        return call

    def start(self) -> None:
        """Reset for a step whose 0 the ranks agree on (shared.origin)."""
        self.events, self.peak = [], 0
        self.t0 = shared.origin()


def build_schedule(name, model, args, ctx):
    """(schedule, this rank's stage modules, StageClock) for `name` on a copy of `model`."""
    from torch.distributed import pipelining

    from labkit.parallel.pipe import causal_lm_loss, split_model

    p, rank = ctx.world_size, ctx.rank
    v = args.chunks if name == "interleaved-1f1b" else 1
    parts = split_model(model, p * v)
    mods = [shared.Slowed(parts[c * p + rank], args.sleep / v) for c in range(v)]
    stages = [pipelining.PipelineStage(mod, c * p + rank, p * v, ctx.device)
              for c, mod in enumerate(mods)]
    cls = getattr(pipelining, CLASSES[name])
    multi = name in ("interleaved-1f1b", "zero-bubble")
    schedule = cls(stages if multi else stages[0], args.microbatches, loss_fn=causal_lm_loss)
    return schedule, mods, StageClock(stages, rank, p)


def run_one(name, base, ids, ref, args, ctx) -> dict:
    from labkit.comm import step_communication

    p, m, rank = ctx.world_size, args.microbatches, ctx.rank
    v = args.chunks if name == "interleaved-1f1b" else 1
    model = copy.deepcopy(base)
    schedule, mods, clock = build_schedule(name, model, args, ctx)
    inputs = (ids,) if rank == 0 else ()
    target = ids if rank == p - 1 else None

    def step(seconds=args.sleep):
        model.zero_grad(set_to_none=True)
        for mod in mods:
            mod.sleep.seconds = seconds / v
            mod.sleep.weight.grad = None
        losses: list = []
        clock.start()
        with measure.CollectiveCounter() as counter, noise.ignoring(noise.PAST_KEY_VALUES):
            schedule.step(*inputs, target=target, losses=losses)
        sends = counter.by_kind.get("send", (0, 0))
        events = sorted((e for rank_events in shared.gather(clock.events) for e in rank_events),
                        key=lambda e: (e["start"], e["stage"]))
        return events, (losses, sends, clock.peak)

    step(0.0)                                              # warm-up: shapes inferred
    row, (losses, sends, peak) = shared.least_disturbed_step(step, args.repeats, name, p, m, v)
    loss = [x for x in shared.gather(torch.stack(losses).mean().item() if losses else None)
            if x is not None][0]
    comm = step_communication("pp", model=shared.spec_of(args), pp=p,
                              batch_size=args.micro_batch, seq_len=args.seq, microbatches=m,
                              chunks=v, activation_bytes=4).payload["send_recv"]
    sent = shared.gather(list(sends))
    busiest = max(sent)
    row.update(torch_class=CLASSES[name], loss=loss, loss_diff=abs(loss - ref[0]),
               grad_max_diff=shared.all_max(shared.grad_diff(model, mods, ref[1])),
               peak_in_flight=[k / v for k in shared.gather(peak)], sends=sent,
               predicted_sends=[comm[0], comm[1]],
               ratio_sends=[busiest[0] / comm[0], busiest[1] / comm[1]])
    return row


def run_torch(args, ctx) -> dict:
    base, _ = shared.build(args)
    ids = shared.batch(args)
    ref = shared.reference(base, ids)
    rows = {name: run_one(name, base, ids, ref, args, ctx) for name in SCHEDULES}
    return dict(part="torch", rank=ctx.rank, world_size=ctx.world_size,
                microbatches=args.microbatches, chunks=args.chunks, sleep=args.sleep,
                reference_loss=ref[0], schedules=rows)


def print_torch(r: dict) -> None:
    from labkit.labs.pp.byhand import print_rows

    print(f"torch.distributed.pipelining: p={r['world_size']}, m={r['microbatches']}, "
          f"interleaved v={r['chunks']}, sleep {r['sleep']:g} s forward (2x backward); loss "
          f"vs one process {r['reference_loss']:.6f}")
    print_rows(r["schedules"])
    print(f"  {'schedule':<18}{'sends (busiest rank)':>22}{'predicted':>11}{'bytes':>12}"
          f"{'predicted':>12}")
    for name, row in r["schedules"].items():
        got = max(row["sends"])
        print(f"  {name:<18}{got[0]:>22}{row['predicted_sends'][0]:>11}{got[1]:>12,}"
              f"{row['predicted_sends'][1]:>12,.0f}")
