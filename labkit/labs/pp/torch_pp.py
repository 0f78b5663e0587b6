"""--part torch of labkit.labs.pp: torch.distributed.pipelining's schedules on manual
PipelineStages cut from the same transformers Llama (labkit.parallel.pipe.split_model), measured.

    labkit run pp -n 4 -- --part torch                              # the four of SCHEDULES
    labkit run pp -n 4 -- --part torch --schedules zbv,dualpipev    # V_SHAPED (or: all)

labkit.labs.pp.lab calls run_torch(args, ctx) and print_torch; `StageClock` times each stage's
ops. SCHEDULES (ZB-H1, Qi et al. 2024, as labkit.pipeline's "zero-bubble") run by default;
V_SHAPED (ZB-V, the same paper §6; DualPipeV after DeepSeek-V3's DualPipe: two stages per rank
in a V) when asked for. How each is measured: docs/labs.md, ## pp.
"""
from __future__ import annotations

import copy
import time

import torch

from labkit.labs.common import pipeline as shared
from labkit.runtime import measure, noise

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")      # --part torch's default
V_SHAPED = ("zbv", "dualpipev")
ALL = SCHEDULES + V_SHAPED
CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
           "interleaved-1f1b": "ScheduleInterleaved1F1B",
           "zero-bubble": "ScheduleInterleavedZeroBubble",
           "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")       # the schedules that run W apart


def held_stages(name: str, rank: int, p: int, v: int) -> list[int]:
    """The virtual stages `rank` holds under `name`, in chunk order: one (its own), interleaved
    v in a loop (r, r + p, ...: Megatron-LM's), V-shaped two in a V (r and 2p - 1 - r)."""
    if name == "interleaved-1f1b":
        return [c * p + rank for c in range(v)]
    if name in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [rank]


def chunks_of(name: str, v: int) -> int:
    return v if name == "interleaved-1f1b" else 2 if name in V_SHAPED else 1


def named_args(args):
    """args for torch's schedules by name: --part custom's run at --microbatches, else 8."""
    if args.microbatches is not None:
        return args
    named = copy.copy(args)
    named.microbatches = 8
    return named


def placement(name: str, p: int, v: int) -> dict[int, int]:
    """{virtual stage: rank} of `name` on p ranks."""
    return {s: r for r in range(p) for s in held_stages(name, r, p, v)}


class StageClock:
    """Times the compute of this rank's PipelineStages: events as the simulator's (how they are
    timed: docs/labs.md, ## pp), and the most micro-batches held at once.

    Event kinds, as labkit.pipeline's: F forward; B the backward (backward_one_chunk), or its
    input gradient alone where the schedule splits it (full_backward=False, torch's I); W the
    weight gradient (backward_weight_one_chunk); with `split`, a full backward (torch's B, the
    input and weight gradients in one pass) is "BW", which the simulator draws as B then W."""

    WRAPPED = {"forward_one_chunk": "F", "backward_one_chunk": "B",
               "backward_weight_one_chunk": "W"}

    def __init__(self, stages, rank: int, split: bool = False):
        self.stages, self.rank, self.split = stages, rank, split
        self.chunk = {s.stage_index: c for c, s in enumerate(
            sorted(stages, key=lambda s: s.stage_index))}
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
            what = kind
            if kind == "B" and self.split and kwargs.get("full_backward", True):
                what = "BW"
            self.events.append({"stage": self.rank, "kind": what, "microbatch": int(mb),
                                "chunk": self.chunk[stage.stage_index],
                                "start": start - self.t0, "end": end - self.t0})
            self.held = sum(len(s.fwd_cache) for s in self.stages)
            self.peak = max(self.peak, self.held)
            return out
        return call

    def start(self) -> None:
        """Reset for a step whose 0 the ranks agree on (shared.origin)."""
        self.events, self.peak = [], 0
        self.t0 = shared.origin()


def make_stages(model, held: list[int], n: int, seconds: float, device):
    """(PipelineStages, their Slowed modules) of the virtual stages `held` of `model` cut into
    n, each sleeping `seconds` / len(held) (a rank's stages together sleep `seconds`)."""
    from torch.distributed import pipelining

    from labkit.parallel.pipe import split_model

    parts = split_model(model, n)
    mods = [shared.Slowed(parts[s], seconds / len(held)) for s in held]
    stages = [pipelining.PipelineStage(mod, s, n, device) for s, mod in zip(held, mods)]
    return stages, mods


def build_schedule(name, model, args, ctx):
    """(schedule, this rank's stage modules, StageClock) for `name` on a copy of `model`."""
    from torch.distributed import pipelining

    from labkit.parallel.pipe import causal_lm_loss

    p, rank = ctx.world_size, ctx.rank
    v = chunks_of(name, args.chunks)
    stages, mods = make_stages(model, held_stages(name, rank, p, args.chunks), p * v,
                               args.sleep, ctx.device)
    cls = getattr(pipelining, CLASSES[name])
    multi = len(stages) > 1 or name == "zero-bubble"
    schedule = cls(stages if multi else stages[0], args.microbatches, loss_fn=causal_lm_loss)
    return schedule, mods, StageClock(stages, rank, split=name in SPLIT_BACKWARD)


def timed_step(schedule, model, mods, clock, ids, args, v):
    """step(seconds) for shared.least_disturbed_step: one step of `schedule` on every rank,
    returning (every rank's events, (this rank's losses, its sends, its peak held)); each of
    this rank's v stages sleeps seconds / v. The rank holding the first stage feeds the batch,
    the one holding the last the targets (in a V, rank 0 both)."""
    first = any(s.is_first for s in clock.stages)
    last = any(s.is_last for s in clock.stages)
    inputs = (ids,) if first else ()
    target = ids if last else None

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
    return step


def step_result(model, mods, ref, losses, sends, peak, v: int) -> dict:
    """Loss and gradients against one process, the sends of each rank, the peak each held."""
    loss = [x for x in shared.gather(torch.stack(losses).mean().item() if losses else None)
            if x is not None][0]
    return dict(loss=loss, loss_diff=abs(loss - ref[0]),
                grad_max_diff=shared.all_max(shared.grad_diff(model, mods, ref[1])),
                peak_in_flight=[k / v for k in shared.gather(peak)],
                sends=shared.gather(list(sends)))


def run_one(name, base, ids, ref, args, ctx) -> dict:
    from labkit.comm import step_communication

    p, m = ctx.world_size, args.microbatches
    v = chunks_of(name, args.chunks)
    model = copy.deepcopy(base)
    schedule, mods, clock = build_schedule(name, model, args, ctx)
    step = timed_step(schedule, model, mods, clock, ids, args, v)
    step(0.0)                                              # warm-up: shapes inferred
    row, (losses, sends, peak) = shared.least_disturbed_step(step, args.repeats, name, p, m, v)
    row.update(torch_class=CLASSES[name], **step_result(model, mods, ref, losses, sends, peak, v))
    each = shared.predicted_sends(placement(name, p, args.chunks), m, shared.message_bytes(args))
    if name in V_SHAPED:       # step_communication prices the loop placement, not the V
        predicted = max(each)
    else:
        predicted = step_communication(
            "pp", model=shared.spec_of(args), pp=p, batch_size=args.micro_batch,
            seq_len=args.seq, microbatches=m, chunks=v, activation_bytes=4).payload["send_recv"]
    busiest = max(row["sends"])
    row.update(predicted_sends=[predicted[0], predicted[1]], predicted_sends_per_rank=each,
               ratio_sends=[busiest[0] / predicted[0], busiest[1] / predicted[1]],
               placement=placement(name, p, args.chunks))
    return row


def run_torch(args, ctx) -> dict:
    base, _ = shared.build(args)
    ids = shared.batch(args)
    ref = shared.reference(base, ids)
    rows = {name: run_one(name, base, ids, ref, args, ctx) for name in args.schedules}
    return dict(part="torch", rank=ctx.rank, world_size=ctx.world_size,
                microbatches=args.microbatches, chunks=args.chunks, sleep=args.sleep,
                reference_loss=ref[0], schedules=rows)


def print_torch(r: dict) -> None:
    from labkit.labs.pp.byhand import print_rows

    print(f"torch.distributed.pipelining: p={r['world_size']}, m={r['microbatches']}, "
          f"interleaved v={r['chunks']}, sleep {r['sleep']:g} s forward (2x backward); loss "
          f"vs one process {r['reference_loss']:.6f}")
    print_rows(r["schedules"])
    print_sends(r["schedules"])


def print_sends(rows: dict) -> None:
    """Per schedule: the sends of the busiest rank and their bytes, counted vs predicted, and
    every rank's count beside its prediction."""
    print(f"  {'schedule':<18}{'sends busiest':>14}{'pred':>6}{'bytes':>10}{'pred':>10}"
          f"{'ratio':>7}  per rank (counted/predicted)")
    for name, row in rows.items():
        got = max(row["sends"])
        each = " ".join(f"{a[0]}/{b[0]}" for a, b in zip(row["sends"],
                                                        row["predicted_sends_per_rank"]))
        print(f"  {name:<18}{got[0]:>14}{row['predicted_sends'][0]:>6.0f}{got[1]:>10,}"
              f"{row['predicted_sends'][1]:>10,.0f}{row['ratio_sends'][0]:>7.2f}  {each}")
