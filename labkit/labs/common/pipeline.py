"""What every part of the pipeline lab (labkit.labs.pp) shares: the model (a transformers Llama
from a config, untied head), its stages with a sleeping compute layer (clean timelines on shared
cores), the one-process reference, and a measured step set beside `labkit.pipeline.simulate`.

    row, payload = least_disturbed_step(step, repeats, schedule, p, m, v)   # the shortest step
    row = beside(schedule, events, p, m, v)     # a measured step beside simulate() at its costs

Why the stages sleep: `Slowed`; how a step's costs are read (op cost, overhead, p2p): `costs`;
how the idle shares compare: `beside`. Source: labkit.pipeline (simulate, idle_share).
"""
from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as tdist
from torch import nn


class Slowed(nn.Module):
    """A pipeline stage followed by a SleepLayer: what the stage computes, then `seconds` of
    sleep (2x in the backward). Keeps the stage's index, stages, boundary and loss_fn, so the
    hand-built schedules and torch's PipelineStage take it as they take the stage.

    Each stage (each chunk, interleaved: 1/v of it) ends with a labkit.parallel.pipe SleepLayer:
    forward `--sleep` seconds, backward twice that. The model's own compute is small beside it,
    so the measured timeline is the schedule's, not the CPU scheduler's."""

    def __init__(self, stage: nn.Module, seconds: float):
        from labkit.parallel.pipe import SleepLayer

        super().__init__()
        self.stage = stage
        self.sleep = SleepLayer(seconds)
        self.index, self.stages = getattr(stage, "index", 0), getattr(stage, "stages", 1)
        if hasattr(stage, "loss_fn"):
            self.loss_fn = stage.loss_fn
        if hasattr(stage, "boundary"):
            self.boundary = stage.boundary

    def forward(self, x):
        return self.sleep(self.stage(x))


def spec_of(args):
    from labkit.models import get_model

    return get_model("debug-llama").with_(
        name="lab-pp-llama", num_layers=args.layers, hidden_size=args.hidden,
        num_heads=args.heads, num_kv_heads=args.kv_heads, ffn_size=2 * args.hidden,
        vocab_size=args.vocab, max_seq_len=max(args.seq, 64))


def build(args):
    """(model, spec): a LlamaForCausalLM from config (untied head, fp32, sdpa), seeded: the
    same weights on every rank."""
    from labkit.labs.common.models import build_model

    spec = spec_of(args)
    torch.manual_seed(args.seed)
    return build_model(spec, "silu", torch.float32, attention="sdpa"), spec


def batch(args, replicas: int = 1, step: int = 0) -> torch.Tensor:
    """Step `step`'s token ids [replicas x m x micro-batch, seq] (replicas: data-parallel
    replicas, each takes its slice), seeded: the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 11 + step)
    rows = replicas * args.microbatches * args.micro_batch
    return torch.randint(0, args.vocab, (rows, args.seq), generator=gen)


def reference(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict]:
    """(loss, {name: grad}) of one process on the whole batch: transformers' causal-LM loss."""
    from labkit.parallel.pipe import causal_lm_loss

    ref = copy.deepcopy(model)
    loss = causal_lm_loss(ref(ids).logits, ids)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def grad_diff(model: nn.Module, modules, ref_grads: dict) -> float:
    """Max |grad - the reference's| over the model's parameters held by `modules` (a stage's
    SleepLayer weight, not in the model, is left out); 0.0 when they hold none."""
    names = {id(p): n for n, p in model.named_parameters()}
    diffs = [(p.grad - ref_grads[names[id(p)]]).abs().max().item()
             for mod in modules for p in mod.parameters()
             if id(p) in names and p.grad is not None]
    return max(diffs, default=0.0)


def origin() -> float:
    """time.perf_counter() of the step's 0 on this rank: after a barrier, rank 0's reading
    when every rank runs on this host (CLOCK_MONOTONIC is one clock for all its processes,
    so the ranks' timelines line up exactly), else this rank's own (ranks leave a barrier
    within a network latency of each other)."""
    import time

    from labkit.runtime import dist

    tdist.barrier()
    t = torch.tensor([time.perf_counter()], dtype=torch.float64)
    if dist.local_world_size() == dist.world_size():
        tdist.broadcast(t, src=0)
    return t.item()


def all_max(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.item()


def gather(obj) -> list:
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def durations(events, kind: str) -> float:
    """Mean seconds of the `kind` events (0.0 if none)."""
    xs = [e["end"] - e["start"] for e in events if e["kind"] == kind]
    return statistics.fmean(xs) if xs else 0.0


def formula(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of the step in closed form ((p-1)/(m+p-1), interleaved (p-1)/(vm+p-1));
    zero-bubble at f = b = w: (p-1)/(3m+p-1)."""
    k = {"interleaved-1f1b": v, "zero-bubble": 3}.get(schedule, 1)
    return (p - 1) / (k * m + p - 1)


def _gaps(events: list, p: int, v: int = 1) -> tuple[list, list]:
    """(waited, ready): for every op after a stage's first, the time from the end of what it
    waited for to its start. waited: its message came from another stage after this stage's
    previous op ended (the gap from that message's op's end: p2p); ready: its input was there
    by then (the gap from the previous op's end: the framework's per-op overhead)."""
    by_key = {(e["kind"], e["microbatch"], e["chunk"] * p + e["stage"]): e for e in events}
    last = p * v - 1
    waited, ready, prev = [], [], {}
    for e in sorted(events, key=lambda e: (e["start"], e["stage"])):
        vs = e["chunk"] * p + e["stage"]
        if e["kind"] == "F":
            dep = by_key.get(("F", e["microbatch"], vs - 1))
        elif e["kind"] == "B":
            dep = by_key.get(("F" if vs == last else "B", e["microbatch"],
                              vs if vs == last else vs + 1))
        else:
            dep = by_key.get(("B", e["microbatch"], vs))
        before = prev.get(e["stage"])
        if before is not None:
            if dep is not None and dep["stage"] != e["stage"] and dep["end"] > before["end"]:
                waited.append(e["start"] - dep["end"])
            else:
                ready.append(e["start"] - before["end"])
        prev[e["stage"]] = e
    return waited, ready


def costs(events: list, p: int, v: int = 1) -> dict:
    """This run's costs for simulate: mean compute of F, B, W per stage (all its chunks; W per
    op), the per-op `overhead`, `p2p` net of it (`latency` before).

    `labkit.pipeline.simulate(schedule, p, m, fwd, bwd[, wgrad], p2p)` runs at these costs, all
    means over the step's events (the step is a sum of ops along its critical path, so the mean
    is the statistic whose sum is the run's):
    - op cost = the measured compute (an F, B or W event's duration, one stage, all its chunks)
      plus `overhead`: what the framework does on the stage between two ops when the next op's
      input is already there (posting the last op's sends and this op's receives, waiting on
      them, the loss on the last stage): the stage is not computing then, but the next op cannot
      start either. torch.distributed.pipelining spends 1 to 3 ms there per op on a loaded CPU
      (the hand-built schedules less); left out, its step is longer than the simulator's and its
      idle share 5 to 10 points above.
    - p2p = the measured time from an op's end to the start of the op on another stage that
      waited for its message (`_gaps`), less `overhead` (already charged to the sender's op)."""
    f, b = (durations(events, k) * v for k in "FB")
    waited, ready = _gaps(events, p, v)
    overhead = max(0.0, statistics.fmean(ready)) if ready else 0.0
    latency = max(0.0, statistics.fmean(waited)) if waited else 0.0
    return dict(fwd=f, bwd=b, wgrad=durations(events, "W"), overhead=overhead,
                p2p=max(0.0, latency - overhead), latency=latency)


def least_disturbed_step(step, repeats: int, schedule: str, p: int, m: int, v: int = 1):
    """(row, payload) of the least disturbed of `repeats` steps: step() runs one measured step on
    every rank and returns (every rank's events, payload); row is `beside` for the step that
    took the least time (timeit's rule: on loaded, shared cores another process can stall a rank
    for milliseconds, which only ever lengthens a step and adds idle time, so the shortest step
    is the one closest to the schedule itself). Every step's measured and simulated idle share and
    length are kept in row["repeats"] (row["idle_repeats"]: the measured ones)."""
    runs = []
    for _ in range(repeats):
        events, payload = step()
        runs.append((beside(schedule, events, p, m, v), payload))
    best = min(range(repeats), key=lambda i: runs[i][0]["step_measured"])
    row, payload = runs[best]
    row["idle_repeats"] = [r["idle_measured"] for r, _ in runs]
    row["repeats"] = [dict(idle_measured=r["idle_measured"], idle_simulated=r["idle_simulated"],
                           step_measured=r["step_measured"]) for r, _ in runs]
    row["chosen_repeat"] = best
    return row, payload


def _simulate(row: dict):
    """simulate() at a `beside` row's costs: each op's compute plus the per-op overhead, p2p
    net of it (`costs`)."""
    from labkit.pipeline import simulate

    o, v = row["overhead_s"], row["chunks"]
    kw = {"wgrad": max(row["wgrad_s"] + o, 1e-6)} if row["schedule"] == "zero-bubble" else {}
    return simulate(row["schedule"], row["stages"], row["microbatches"], fwd=row["fwd_s"] + v * o,
                    bwd=row["bwd_s"] + v * o, chunks=v, p2p=row["p2p_s"], **kw)


def simulated(row: dict) -> list[dict]:
    """The events of simulate() at a `beside` row's costs, each cut to its compute (the overhead
    after it is idle, as in the measured step): drawn beside the measured events
    (labkit.plots.pp.beside), their idle share is row["idle_simulated"]."""
    o = row["overhead_s"]
    return [dict(stage=e.stage, kind=e.kind, microbatch=e.microbatch, chunk=e.chunk,
                 start=e.start, end=e.end - o) for e in _simulate(row).events]


def beside(schedule: str, events: list, p: int, m: int, v: int = 1) -> dict:
    """A measured step (every rank's events) beside simulate() at its measured op costs: the
    idle shares and their difference in points, whether each stage ran the simulator's order,
    the peak in-flight micro-batches the simulator predicts, the costs used.

    The simulated idle share is labkit.pipeline.idle_share of the simulated ops cut back to
    their compute (`simulated`), as the measured one counts only compute busy: the overhead is
    idle time on both sides, and both steps end with the last compute. The closed form
    (p - 1)/(m + p - 1) (interleaved: (p - 1)/(v m + p - 1)) is reported beside it."""
    from labkit.parallel.pipe import stage_orders
    from labkit.pipeline import idle_share

    c = costs(events, p, v)
    row = dict(schedule=schedule, stages=p, microbatches=m, chunks=v, fwd_s=c["fwd"],
               bwd_s=c["bwd"], p2p_s=c["p2p"], overhead_s=c["overhead"],
               wgrad_s=c["wgrad"] if schedule == "zero-bubble" else None)
    sim = _simulate(row)
    got, want = stage_orders(events), stage_orders(sim)
    no_w = {s: [op for op in ops if op[0] != "W"] for s, ops in got.items()}
    cut = simulated(row)
    measured, idle_sim = idle_share(events, p), idle_share(cut, p)
    return dict(row, idle_measured=measured, idle_simulated=idle_sim, idle_formula=formula(
                    schedule, p, m, v), difference_points=100 * (measured - idle_sim),
                same_order=got == want, stages_out_of_order=[s for s in range(p)
                                                             if got.get(s) != want.get(s)],
                same_order_without_w=no_w == {s: [op for op in ops if op[0] != "W"]
                                              for s, ops in want.items()},
                step_measured=max(e["end"] for e in events) - min(e["start"] for e in events),
                step_simulated=max(e["end"] for e in cut) - min(e["start"] for e in cut),
                predicted_in_flight=sim.peak_in_flight,
                events=events)
