"""Pipeline schedules as event lists, and a discrete-event simulation of them.

    >>> r = simulate("1f1b", stages=4, microbatches=8, fwd=1.0, bwd=2.0)
    >>> r.makespan, r.bubble_fraction, r.peak_in_flight        # 33.0, 3/11, [4, 3, 2, 1]

`fwd` and `bwd` are the times of one micro-batch through one whole stage (all its layers);
with `chunks` = v model chunks per stage (interleaving) each chunk takes fwd/v and bwd/v.

Each stage runs its schedule's operations in order; an operation starts when its stage is free
and its input is ready (the previous virtual stage's forward, the next one's backward), plus
`p2p` seconds for a send between stages. With p2p = 0 and uniform costs the simulation
reproduces Narayanan et al. 2021 (§2.2) exactly:
- GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021): makespan
  (m + p - 1)(f + b); idle share (p - 1)/(m + p - 1); bubble relative to the ideal m(f + b):
  (p - 1)/m. GPipe holds all m micro-batches' activations, 1F1B at most p (stage i: p - i).
- Interleaved 1F1B with v chunks (requires m a multiple of p, as Megatron-LM does): the bubble
  relative to ideal is (p - 1)/(v m). At m = p labkit follows pre-2024 Megatron-LM, which
  ran all m*v forwards before the first backward; current Megatron-Core and
  torch.distributed.pipelining warm up as for m > p and then alternate. The makespan is the
  same; the order, and how many micro-batches a stage holds at once, differ.
- "zero-bubble" (ZB-H1, Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward is
  split into B (input gradient, `bwd`) and W (weight gradient, `wgrad`); W waits to fill what
  would be idle time, keeping 1F1B's limit of p - i micro-batches in flight. With
  f = b = w (the paper's setting) its makespan is m(f + b + w) + (p - 1)(f + b - w), against
  1F1B's (m + p - 1)(f + b + w) (paper, §3.1); this greedy simulation reproduces that. For
  other ratios the greedy list schedule is a heuristic and can lose to 1F1B (p=2, m=4,
  f=0.138, b=1, w=0.25: 7.192 against 6.942: a W started in a gap delays a B that became
  ready just after). So the simulator also runs the order with no W deferred (1F1B with the
  backward split, each W right after its B) and keeps the shorter step, as the paper's
  automatic scheduler keeps the best of its candidates. That order is never slower than 1F1B
  (each op starts no later; a B's successor waits for B alone, not B + W), so neither is
  zero-bubble, at the same in-flight bound. Its bubble need not shrink with every extra
  micro-batch at other ratios (p=5, f=2.5, b=w=2.84: 0.2173 at m=5, 0.2202 at m=6).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit import validate

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
MAX_STAGES = 1024           # stages (and chunks per stage) the simulator accepts
MAX_MICROBATCHES = 65536
MAX_OPS = 2_000_000         # stages x microbatches x chunks (about 10 s of simulation)


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str           # "F" forward, "B" backward (input grad for zero-bubble), "W" weight grad
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class PipelineResult:
    schedule: str
    stages: int
    microbatches: int
    chunks: int
    events: list = field(default_factory=list)
    makespan: float = 0.0
    ideal: float = 0.0                 # one stage's busy time: m (f + b [+ w])
    peak_in_flight: list = field(default_factory=list)   # per stage, in micro-batches

    @property
    def busy(self) -> list[float]:
        out = [0.0] * self.stages
        for e in self.events:
            out[e.stage] += e.end - e.start
        return out

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step: idle time of all stages / (stages x makespan)."""
        return 1 - sum(self.busy) / (self.stages * self.makespan)

    @property
    def bubble_ratio(self) -> float:
        """Bubble relative to the ideal time: (makespan - ideal) / ideal ((p-1)/m for 1F1B)."""
        return (self.makespan - self.ideal) / self.ideal


def _order(schedule, p, m, v):
    """Per-stage list of (kind, microbatch, chunk) in execution order."""
    if schedule == "gpipe":
        return [[("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
                for _ in range(p)]
    if schedule == "1f1b":
        orders = []
        for i in range(p):
            warm = min(p - i - 1, m)
            o = [("F", j, 0) for j in range(warm)]
            for j in range(m - warm):
                o += [("F", warm + j, 0), ("B", j, 0)]
            o += [("B", j, 0) for j in range(m - warm, m)]
            orders.append(o)
        return orders
    # interleaved 1F1B, in the order of Megatron-LM's forward_backward_pipelining_with_interleaving
    total = m * v

    def fwd(k):
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    orders = []
    for i in range(p):
        warm = total if m == p else min((p - i - 1) * 2 + (v - 1) * p, total)
        o = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            o += [fwd(warm + k), bwd(k)]
        o += [bwd(k) for k in range(total - warm, total)]
        orders.append(o)
    return orders


def simulate(schedule, stages, microbatches, fwd=1.0, bwd=2.0, chunks=1, wgrad=None,
             p2p=0.0) -> PipelineResult:
    """Simulate one training step of a pipeline schedule.

    schedule: "gpipe" | "1f1b" | "interleaved-1f1b" | "zero-bubble".
    stages (p), microbatches (m), chunks (v, interleaved only; 1 otherwise).
    fwd, bwd: seconds per micro-batch per stage. For "zero-bubble", `bwd` is the input-gradient
    pass B alone and `wgrad` the weight-gradient pass W (default: equal to bwd, as the paper's
    T_F = T_B = T_W); other schedules take no wgrad (their bwd includes it).
    p2p: seconds to send activations or gradients between stages.
    """
    validate.choice("schedule", schedule, SCHEDULES)
    # The simulation runs op by op (3 p m v of them): bounds keep a typo from running for hours.
    p = validate.positive_int("stages", stages, MAX_STAGES)
    m = validate.positive_int("microbatches", microbatches, MAX_MICROBATCHES)
    v = validate.positive_int("chunks", chunks, MAX_STAGES)
    if p * m * v > MAX_OPS:
        raise ValueError(f"stages x microbatches x chunks = {p * m * v:,} is more than this "
                         f"simulator steps through ({MAX_OPS:,}); allowed: a product up to that")
    f = validate.positive("fwd", fwd)
    b = validate.positive("bwd", bwd)
    c = validate.non_negative("p2p", p2p)
    if schedule != "interleaved-1f1b" and v != 1:
        raise ValueError(f"chunks={v} needs schedule='interleaved-1f1b'; allowed for "
                         f"{schedule!r}: 1")
    if schedule == "interleaved-1f1b" and m % p:
        raise ValueError(f"microbatches={m} must be a multiple of stages={p} for "
                         "interleaved-1f1b (as in Megatron-LM); allowed: "
                         + ", ".join(str(p * k) for k in range(1, 5)) + ", ...")
    if schedule == "zero-bubble":
        w = validate.positive("wgrad", b if wgrad is None else wgrad)
        return _simulate_zero_bubble(p, m, f, b, w, c)
    if wgrad is not None:
        raise ValueError(f"wgrad={wgrad!r} needs schedule='zero-bubble'; allowed for "
                         f"{schedule!r}: None (the backward's weight gradient is part of bwd)")

    orders = _order(schedule, p, m, v)
    return _run_orders(schedule, orders, p, m, v, {"F": f / v, "B": b / v}, c, m * (f + b))


def _run_orders(schedule, orders, p, m, v, cost, c, ideal) -> PipelineResult:
    """Run per-stage orders of (kind, microbatch, chunk): each op starts when its stage is free
    and its input is ready (a W needs only its own B, which comes before it on its stage)."""
    last = p * v - 1
    done: dict = {}                 # (kind, microbatch, virtual stage) -> end time
    free = [0.0] * p
    pos = [0] * p
    events = []
    held = [0] * p
    peak = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while pos[i] < len(orders[i]):
                kind, j, ch = orders[i][pos[i]]
                vs = ch * p + i     # virtual stage (Megatron: chunk ch of stage i)
                if kind == "F":
                    dep = None if vs == 0 else ("F", j, vs - 1)
                elif kind == "B":
                    dep = ("F", j, last) if vs == last else ("B", j, vs + 1)
                else:
                    dep = ("B", j, vs)
                if dep is not None and dep not in done:
                    break
                sent = dep is not None and dep[2] % p != i      # crosses to another stage
                ready = 0.0 if dep is None else done[dep] + (c if sent else 0.0)
                start = max(free[i], ready)
                end = start + cost[kind]
                done[(kind, j, vs)] = end
                free[i] = end
                events.append(Event(i, kind, j, ch, start, end))
                held[i] += {"F": 1, "B": -1}.get(kind, 0)
                peak[i] = max(peak[i], held[i])
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the orders above are deadlock-free
            raise RuntimeError(f"schedule {schedule!r} deadlocked")
    events.sort(key=lambda e: (e.start, e.stage))
    return PipelineResult(schedule, p, m, v, events, max(free), ideal, [k / v for k in peak])


def _split_1f1b(p, m, f, b, w, c) -> PipelineResult:
    """1F1B with the backward split into B and W, each W right after its B: zero-bubble's
    schedule with nothing deferred."""
    orders = [[op for kind, j, ch in o
               for op in ([(kind, j, ch), ("W", j, ch)] if kind == "B" else [(kind, j, ch)])]
              for o in _order("1f1b", p, m, 1)]
    return _run_orders("zero-bubble", orders, p, m, 1, {"F": f, "B": b, "W": w}, c,
                       m * (f + b + w))


def _simulate_zero_bubble(p, m, f, b, w, c) -> PipelineResult:
    """The shorter of the greedy ZB-H1 schedule and 1F1B with a split backward (see the module
    docstring); on a tie the greedy one, which is the paper's at T_F = T_B = T_W."""
    greedy, split = _greedy_zero_bubble(p, m, f, b, w, c), _split_1f1b(p, m, f, b, w, c)
    return greedy if greedy.makespan <= split.makespan * (1 + 1e-12) else split


def _greedy_zero_bubble(p, m, f, b, w, c) -> PipelineResult:
    """Greedy list scheduling in time order. When a stage is free it runs, by priority: a ready
    B; else a ready F if fewer than p - i micro-batches are in flight (1F1B's bound, as ZB-H1);
    else a pending W. "In flight" counts micro-batches forwarded and not yet through B, as for
    1F1B; a pending W still holds the (smaller) part of the activations it needs, which ZB-H1
    also leaves out of its bound (Qi et al. 2024, §3.1)."""
    f_done: dict = {}
    b_done: dict = {}
    next_f = [0] * p
    w_queue = [[] for _ in range(p)]
    next_b = [0] * p
    held = [0] * p
    peak = [0] * p
    free = [0.0] * p
    events = []
    total = 3 * p * m
    while len(events) < total:
        best = None
        for i in range(p):
            cands = []
            j = next_b[i]
            if j < m and j < next_f[i]:
                dep = f_done.get((j, p - 1)) if i == p - 1 else b_done.get((j, i + 1))
                if dep is not None:
                    cands.append((max(free[i], dep + (c if i != p - 1 else 0)), 0, "B", j))
            j = next_f[i]
            if j < m and held[i] < p - i:
                dep = 0.0 if i == 0 else f_done.get((j, i - 1))
                if dep is not None:
                    cands.append((max(free[i], dep + (c if i else 0)), 1, "F", j))
            if w_queue[i]:
                cands.append((free[i], 2, "W", w_queue[i][0]))
            for start, prio, kind, j in cands:
                key = (start, prio, i)
                if best is None or key < best[0]:
                    best = (key, i, kind, j)
        # The earliest possible start wins (ties by priority): every op not yet ready depends
        # on one still to run, so it cannot become ready before this start.
        (start, _, _), i, kind, j = best
        dur = {"F": f, "B": b, "W": w}[kind]
        end = start + dur
        events.append(Event(i, kind, j, 0, start, end))
        free[i] = end
        if kind == "F":
            f_done[(j, i)] = end
            next_f[i] += 1
            held[i] += 1
            peak[i] = max(peak[i], held[i])
        elif kind == "B":
            b_done[(j, i)] = end
            next_b[i] += 1
            w_queue[i].append(j)
            held[i] -= 1
        else:
            w_queue[i].pop(0)
    events.sort(key=lambda e: (e.start, e.stage))
    return PipelineResult("zero-bubble", p, m, 1, events, max(free), m * (f + b + w),
                          [float(k) for k in peak])
