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


def formula(schedule: str, p: int, m: int, v: int = 1) -> float | None:
    """The idle share of the step in closed form at the lab's equal costs (f = b = w:
    labkit.pipeline.bubble_formula, e.g. (p-1)/(m+p-1) for 1F1B, (p-1)/(3m+p-1) for
    zero-bubble); None for a learner's schedule, which has none."""
    from labkit.pipeline import SCHEDULES, bubble_formula

    if schedule not in SCHEDULES:
        return None
    return bubble_formula(schedule, p, m, v if schedule == "interleaved-1f1b" else 1,
                          divisible=False)[0]


def loop_placement(p: int, v: int = 1) -> dict[int, int]:
    """{virtual stage: rank} of the loop placement: rank r holds r, r + p, ... (Megatron-LM's)."""
    return {c * p + r: r for c in range(v) for r in range(p)}


def predicted_sends(placement: dict, m: int, size: int) -> list[list[int]]:
    """Per rank [sends, bytes] of one step, from where each virtual stage runs ({stage: rank}):
    a stage sends its activation forward unless it is the last, its input gradient backward
    unless it is the first, once per micro-batch, each `size` bytes, except to a neighbour on
    its own rank: torch.distributed.pipelining hands that over in memory (its "V-schedule
    special case": set_local_fwd_input / set_local_bwd_input, no send). So in the V placement
    the hop between stages p - 1 and p, both on rank p - 1, costs no message."""
    n, ranks = len(placement), max(placement.values()) + 1
    out = [[0, 0] for _ in range(ranks)]
    for s, r in placement.items():
        k = m * ((s != n - 1 and placement[s + 1] != r) + (s != 0 and placement[s - 1] != r))
        out[r][0] += k
        out[r][1] += k * size
    return out


def overlapped_pairs(schedule: str, p: int, m: int, actions: dict | None = None) -> dict:
    """{first pass: second pass}, each (virtual stage, measured kind, micro-batch), of the
    overlapped forward-backward pairs (torch's OVERLAP_F_B) of DualPipeV
    (labkit.pipeline_v's replay of torch's order) or of a hand-written schedule's `actions`
    ({rank: [action strings]}; a full backward B there is measured as "BW" when the schedule
    splits others, else "B")."""
    import re

    if schedule == "dualpipev":
        from labkit.pipeline_v import dualpipev_orders

        return {(a[2], a[0], a[1]): (b[2], b[0], b[1])
                for steps in dualpipev_orders(p, m) for step in steps if len(step) == 2
                for a, b in [step]}
    if not actions:
        return {}
    split = any(re.search(r"\d[IW]\d", a) for row in actions.values() for a in row)
    kind = {"F": "F", "I": "B", "W": "W", "B": "BW" if split else "B"}
    out = {}
    for row in actions.values():
        for a in row:
            ops = re.findall(r"(\d+)([FIBW])(\d+)", a) if "OVERLAP" in a else []
            for (s1, k1, j1), (s2, k2, j2) in zip(ops, ops[1:]):
                out[(int(s1), kind[k1], int(j1))] = (int(s2), kind[k2], int(j2))
    return out


def message_bytes(args) -> int:
    """Bytes of one message between stages: a micro-batch's activation (or its gradient),
    micro-batch x seq x hidden fp32 values."""
    return args.micro_batch * args.seq * args.hidden * 4


def _gaps(events: list, p: int, v: int = 1, placement: dict | None = None,
          pairs: dict | None = None) -> tuple[list, list]:
    """(waited, ready): for every op after a stage's first, the time from the end of what it
    waited for to its start. waited: its message came from another stage after this stage's
    previous op ended (the gap from that message's op's end: p2p); ready: its input was there
    by then (the gap from the previous op's end: the framework's per-op overhead). placement:
    {virtual stage: rank} (default the loop, `loop_placement`); an event's virtual stage is its
    rank's chunk-th (chunks in the order of the stages a rank holds). A full backward "BW"
    counts as a backward; a neighbour on the same rank sends no message (`predicted_sends`).
    pairs: {first pass: second pass} of overlapped pairs, each (virtual stage, kind,
    micro-batch) (`overlapped_pairs`): torch posts a pair's sends after both passes, so the
    first pass's output leaves when the second ends; a wait for it is p2p, not overhead."""
    placement = loop_placement(p, v) if placement is None else placement
    held: dict = {}
    for s in sorted(placement):
        held.setdefault(placement[s], []).append(s)

    def virtual(e):
        return held[e["stage"]][e["chunk"]]

    back = ("B", "BW")
    by_key, out = {}, {}
    for e in events:
        by_key[("B" if e["kind"] in back else e["kind"], e["microbatch"], virtual(e))] = e
        out[(virtual(e), e["kind"], e["microbatch"])] = e
    for first, second in (pairs or {}).items():       # the pair's output leaves at its end
        if first in out and second in out:
            out[first] = dict(out[first], end=out[second]["end"])

    def released(dep):
        return out[(virtual(dep), dep["kind"], dep["microbatch"])]["end"]

    last = len(placement) - 1
    waited, ready, prev = [], [], {}
    for e in sorted(events, key=lambda e: (e["start"], e["stage"])):
        vs = virtual(e)
        if e["kind"] == "F":
            dep = by_key.get(("F", e["microbatch"], vs - 1))
        elif e["kind"] in back:
            dep = by_key.get(("F" if vs == last else "B", e["microbatch"],
                              vs if vs == last else vs + 1))
        else:
            dep = by_key.get(("B", e["microbatch"], vs))
        before = prev.get(e["stage"])
        if before is not None:
            if dep is not None and dep["stage"] != e["stage"] and released(dep) > before["end"]:
                waited.append(e["start"] - released(dep))
            else:
                ready.append(e["start"] - before["end"])
        prev[e["stage"]] = e
    return waited, ready


def costs(events: list, p: int, v: int = 1, placement: dict | None = None,
          pairs: dict | None = None) -> dict:
    """This run's costs for simulate: mean compute of F, B, W per stage (all its chunks), the
    per-op `overhead`, `p2p` net of it (`latency` before).

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
      waited for its message (`_gaps`), less `overhead` (already charged to the sender's op).
    A step that runs some backwards whole ("BW": torch's full backward B, the input and the
    weight gradient in one pass, beside split ones: DualPipeV, a learner's schedule): b + w is
    the mean backward of a micro-batch chunk over all of them, whole or split (the sum over the
    step is the run's), shared between b and w as the split ones share it (half each when none
    is split). placement, pairs: `_gaps`'s."""
    def times(kind):
        return [e["end"] - e["start"] for e in events if e["kind"] == kind]

    fs, bs, ws, bws = (times(k) for k in ("F", "B", "W", "BW"))
    f = statistics.fmean(fs) if fs else 0.0
    b = statistics.fmean(bs) if bs else 0.0
    w = statistics.fmean(ws) if ws else 0.0
    if bws:
        unit = (sum(bs) + sum(ws) + sum(bws)) / (max(len(bs), len(ws)) + len(bws))
        share = sum(bs) / (sum(bs) + sum(ws)) if bs and ws and sum(bs) + sum(ws) > 0 else 0.5
        b, w = unit * share, unit * (1 - share)
    waited, ready = _gaps(events, p, v, placement, pairs)
    overhead = max(0.0, statistics.fmean(ready)) if ready else 0.0
    latency = max(0.0, statistics.fmean(waited)) if waited else 0.0
    return dict(fwd=f * v, bwd=b * v, wgrad=w * v,
                overhead=overhead, p2p=max(0.0, latency - overhead), latency=latency)


def least_disturbed_step(step, repeats: int, schedule: str, p: int, m: int, v: int = 1,
                         **beside_kw):
    """(row, payload) of the least disturbed of `repeats` steps: step() runs one measured step on
    every rank and returns (every rank's events, payload); row is `beside` for the step that
    took the least time (timeit's rule: on loaded, shared cores another process can stall a rank
    for milliseconds, which only ever lengthens a step and adds idle time, so the shortest step
    is the one closest to the schedule itself). Every step's measured and simulated idle share and
    length are kept in row["repeats"] (row["idle_repeats"]: the measured ones). beside_kw:
    `beside`'s placement, simulator and actions."""
    runs = []
    for _ in range(repeats):
        events, payload = step()
        runs.append((beside(schedule, events, p, m, v, **beside_kw), payload))
    best = min(range(repeats), key=lambda i: runs[i][0]["step_measured"])
    row, payload = runs[best]
    row["idle_repeats"] = [r["idle_measured"] for r, _ in runs]
    row["repeats"] = [dict(idle_measured=r["idle_measured"], idle_simulated=r["idle_simulated"],
                           step_measured=r["step_measured"]) for r, _ in runs]
    row["chosen_repeat"] = best
    return row, payload


SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")    # simulate() takes their W apart
V_SHAPED = ("zbv", "dualpipev")                         # two stages per rank, in a V


def _simulate(row: dict, simulator=None):
    """simulate() at a `beside` row's costs: each op's compute plus the per-op overhead, p2p
    net of it (`costs`); `simulator(row, fwd, bwd, wgrad, p2p)` instead where given (a
    learner's schedule: labkit.pipeline_check.simulate_schedule)."""
    from labkit.pipeline import simulate

    o, v = row.get("overhead_pass_s", row["overhead_s"]), row["chunks"]
    f, b, c = row["fwd_s"] + v * o, row["bwd_s"] + v * o, row["p2p_s"]
    w = None if row["wgrad_s"] is None else max(row["wgrad_s"] + v * o, 1e-6)
    if simulator is not None:
        return simulator(row, fwd=f, bwd=b, wgrad=w, p2p=c)
    kw = {"wgrad": w} if row["schedule"] in SPLIT_BACKWARD else {}
    if row["schedule"] not in V_SHAPED:
        kw["chunks"] = v
    return simulate(row["schedule"], row["stages"], row["microbatches"], fwd=f, bwd=b, p2p=c,
                    **kw)


def simulated(row: dict, simulator=None) -> list[dict]:
    """The events of simulate() at a `beside` row's costs, each cut to its compute (the overhead
    after it is idle, as in the measured step): drawn beside the measured events
    (labkit.plots.pp.beside), their idle share is row["idle_simulated"]."""
    o = row.get("overhead_pass_s", row["overhead_s"])
    return [dict(stage=e.stage, kind=e.kind, microbatch=e.microbatch, chunk=e.chunk,
                 start=e.start, end=e.end - o) for e in _simulate(row, simulator).events]


def _expand_full(orders: dict) -> dict:
    """Stage orders with each measured full backward ("BW", one pass) written as the simulator
    draws it: its B part, then its W part."""
    return {s: [x for op in ops for x in ([("B", *op[1:]), ("W", *op[1:])] if op[0] == "BW"
                                          else [op])] for s, ops in orders.items()}


def beside(schedule: str, events: list, p: int, m: int, v: int = 1, placement=None,
           simulator=None, actions=None) -> dict:
    """A measured step (every rank's events) beside simulate() at its measured op costs: the
    idle shares and their difference in points, whether each stage ran the simulator's order,
    the peak in-flight micro-batches the simulator predicts, the costs used.

    The simulated idle share is labkit.pipeline.idle_share of the simulated ops cut back to
    their compute (`simulated`), as the measured one counts only compute busy: the overhead is
    idle time on both sides, and both steps end with the last compute. The closed form
    (p - 1)/(m + p - 1) (interleaved: (p - 1)/(v m + p - 1)) is reported beside it where there
    is one (`formula`). placement: {virtual stage: rank} (default the loop placement; the V
    for zbv and dualpipev); simulator: `_simulate`'s, actions: its rows (a learner's
    schedule)."""
    from labkit.parallel.pipe import stage_orders
    from labkit.pipeline import idle_share

    if placement is None and schedule in V_SHAPED:
        placement = {s: min(s, 2 * p - 1 - s) for s in range(2 * p)}
    c = costs(events, p, v, placement, overlapped_pairs(schedule, p, m, actions))
    split = schedule in SPLIT_BACKWARD or any(e["kind"] in ("W", "BW") for e in events)
    row = dict(schedule=schedule, stages=p, microbatches=m, chunks=v, fwd_s=c["fwd"],
               bwd_s=c["bwd"], p2p_s=c["p2p"], overhead_s=c["overhead"],
               wgrad_s=c["wgrad"] if split else None)
    whole = sum(e["kind"] == "BW" for e in events)
    if whole:   # the simulator runs each BW as two passes, B and W: the step's overhead over them
        row["overhead_pass_s"] = c["overhead"] * len(events) / (len(events) + whole)
    sim = _simulate(row, simulator)
    got, want = _expand_full(stage_orders(events)), stage_orders(sim)
    no_w = {s: [op for op in ops if op[0] != "W"] for s, ops in got.items()}
    cut = simulated(row, simulator)
    measured, idle_sim = idle_share(events, p), idle_share(cut, p)
    return dict(row, idle_measured=measured, idle_simulated=idle_sim, idle_formula=formula(
                    schedule, p, m, v), difference_points=100 * (measured - idle_sim),
                same_order=got == want, stages_out_of_order=[s for s in range(p)
                                                             if got.get(s) != want.get(s)],
                same_order_without_w=no_w == {s: [op for op in ops if op[0] != "W"]
                                              for s, ops in want.items()},
                step_measured=max(e["end"] for e in events) - min(e["start"] for e in events),
                step_simulated=max(e["end"] for e in cut) - min(e["start"] for e in cut),
                predicted_in_flight=list(sim.peak_in_flight),
                events=events)
