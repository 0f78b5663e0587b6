"""Pipeline schedules as event lists, and a discrete-event simulation of them.

    >>> r = simulate("1f1b", stages=4, microbatches=8, fwd=1.0, bwd=2.0)
    >>> r.makespan, r.bubble_fraction, r.peak_in_flight        # 33.0, 3/11, [4, 3, 2, 1]
    >>> bubble_formula("1f1b", 4, 8)            # (3/11, 3/8): of the step, relative to ideal
    >>> min_microbatches(8, 0.10)               # 63 micro-batches for 10 % of the step idle
    >>> activation_in_flight("gpipe", 4, 8), p2p_messages(4, 8, v=2), idle_share(events)

Schedules: GPipe (Huang et al. 2019), 1F1B and interleaved 1F1B (Narayanan et al. 2021, §2.2),
zero-bubble ZB-H1 and ZB-V (Qi et al. 2024), DualPipeV (DeepSeek-AI 2024); how each is simulated,
and checked: `simulate`. A schedule written by hand: check_schedule, simulate_schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import validate
from labkit.pipeline_events import Event, PipelineResult, as_events, idle_share, run_orders
from labkit.pipeline_v import (dualpipev_orders, paper_bubble, v_peak_chunks, v_place, v_units,
                               zbv_orders)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")     # two chunks per rank in a V (labkit.pipeline_v)
MAX_STAGES = 1024           # stages (and chunks per stage) the simulator accepts
MAX_MICROBATCHES = 65536
MAX_OPS = 2_000_000         # stages x microbatches x chunks (about 10 s of simulation)


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
    # interleaved 1F1B, in the order of Megatron-LM's forward_backward_pipelining_with_interleaving.
    # At m = p labkit follows pre-2024 Megatron-LM, which ran all m*v forwards before the first
    # backward; current Megatron-Core and torch.distributed.pipelining warm up as for m > p and
    # then alternate. The makespan is the same; the order, and how many micro-batches a stage
    # holds at once, differ.
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

    schedule: "gpipe" | "1f1b" | "interleaved-1f1b" | "zero-bubble" | "zbv" | "dualpipev".
    stages (p, ranks), microbatches (m), chunks (v: interleaved only; zbv and dualpipev place
    2 on each rank: leave it out or give 2; 1 otherwise).
    fwd, bwd: seconds per micro-batch per stage. For "zero-bubble", "zbv" and "dualpipev",
    `bwd` is the input-gradient pass (torch's I) alone and `wgrad` the weight-gradient pass W
    (default: equal to bwd, as the papers' T_F = T_B = T_W); other schedules take no wgrad
    (their bwd includes it).
    p2p: seconds to send activations or gradients between ranks.

    `fwd` and `bwd` are the times of one micro-batch through one whole stage (all its layers);
    with `chunks` = v model chunks per stage (interleaving, V schedules) each chunk takes fwd/v
    and bwd/v. Each stage runs its schedule's operations in order; an operation starts when its
    stage is free and its input is ready (the previous virtual stage's forward, the next one's
    backward), plus `p2p` seconds for a send between stages. With p2p = 0 and uniform costs the
    simulation reproduces Narayanan et al. 2021 (§2.2) exactly:
    - GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021): makespan
      (m + p - 1)(f + b); idle share (p - 1)/(m + p - 1); bubble relative to the ideal
      m(f + b): (p - 1)/m. GPipe holds all m micro-batches' activations, 1F1B at most p
      (stage i: p - i).
    - Interleaved 1F1B with v chunks (requires m a multiple of p, as Megatron-LM does): the
      bubble relative to ideal is (p - 1)/(v m). At m = p see `_order`.
    - "zero-bubble" (ZB-H1, Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward
      is split into B (input gradient, `bwd`) and W (weight gradient, `wgrad`); W waits to fill
      what would be idle time, keeping 1F1B's limit of p - i micro-batches in flight. With
      f = b = w (the paper's setting) its makespan is m(f + b + w) + (p - 1)(f + b - w),
      against 1F1B's (m + p - 1)(f + b + w) (paper, §3.1). Other ratios: `_simulate_zero_bubble`.
    - "zbv" (ZB-V, the same paper §6) and "dualpipev" (DeepSeek-V3 report, DualPipe's V half):
      2p stages on p ranks in a V, rank r holding stage r (chunk 0) and 2p - 1 - r (chunk 1),
      in torch 2.13's order (ScheduleZBVZeroBubble, ScheduleDualPipeV: `labkit.pipeline_v`).
      Events: stage = rank, chunk 0 or 1, kind F, B (input gradient) or W; DualPipeV's full
      backwards (torch's B) are drawn as B then W, its gradient sent when both are done, and
      its overlapped forward-backward pairs run one pass after the other, as torch runs them.
      zbv takes any m (torch plans 2p - 1 and drops the rest); dualpipev needs m >= 2p, as
      torch does. Closed forms: `bubble_formula`, `activation_in_flight`, `paper_bubble`.
    """
    # The simulation runs op by op (3 p m v of them): bounds keep a typo from running for hours.
    p, m, v = check_shape(schedule, stages, microbatches, chunks)
    if p * m * v > MAX_OPS:
        raise ValueError(f"stages x microbatches x chunks = {p * m * v:,} is more than this "
                         f"simulator steps through ({MAX_OPS:,}); allowed: a product up to that")
    f = validate.positive("fwd", fwd)
    b = validate.positive("bwd", bwd)
    c = validate.non_negative("p2p", p2p)
    if schedule == "zero-bubble":
        w = validate.positive("wgrad", b if wgrad is None else wgrad)
        return _simulate_zero_bubble(p, m, f, b, w, c)
    if schedule in V_SCHEDULES:
        w = validate.positive("wgrad", b if wgrad is None else wgrad)
        orders = (zbv_orders if schedule == "zbv" else dualpipev_orders)(p, m)
        return run_orders(schedule, orders, v_place(p), {"F": f / 2, "B": b / 2, "W": w / 2}, c,
                          m * (f + b + w), m)
    if wgrad is not None:
        raise ValueError(f"wgrad={wgrad!r} needs schedule='zero-bubble', 'zbv' or 'dualpipev'; "
                         f"allowed for "
                         f"{schedule!r}: None (the backward's weight gradient is part of bwd)")

    orders = _order(schedule, p, m, v)
    return _run_orders(schedule, orders, p, m, v, {"F": f / v, "B": b / v}, c, m * (f + b))


def _run_orders(schedule, orders, p, m, v, cost, c, ideal) -> PipelineResult:
    """Run per-stage orders of (kind, microbatch, chunk), chunk ch of stage i being virtual
    stage ch * p + i (Megatron's placement), with `run_orders`."""
    place = {ch * p + i: (i, ch) for ch in range(v) for i in range(p)}
    steps = [[((kind, j, ch * p + i),) for kind, j, ch in o] for i, o in enumerate(orders)]
    return run_orders(schedule, steps, place, cost, c, ideal, m)


def _split_1f1b(p, m, f, b, w, c) -> PipelineResult:
    """1F1B with the backward split into B and W, each W right after its B: zero-bubble's
    schedule with nothing deferred."""
    orders = [[op for kind, j, ch in o
               for op in ([(kind, j, ch), ("W", j, ch)] if kind == "B" else [(kind, j, ch)])]
              for o in _order("1f1b", p, m, 1)]
    return _run_orders("zero-bubble", orders, p, m, 1, {"F": f, "B": b, "W": w}, c,
                       m * (f + b + w))


def _simulate_zero_bubble(p, m, f, b, w, c) -> PipelineResult:
    """The shorter of the greedy ZB-H1 schedule and 1F1B with a split backward; on a tie the
    greedy one, which is the paper's at T_F = T_B = T_W.

    With f = b = w the greedy simulation reproduces the paper's makespan. For other ratios the
    greedy list schedule is a heuristic and can lose to 1F1B (p=2, m=4, f=0.138, b=1, w=0.25:
    7.192 against 6.942: a W started in a gap delays a B that became ready just after). So the
    simulator also runs the order with no W deferred (1F1B with the backward split, each W right
    after its B) and keeps the shorter step, as the paper's automatic scheduler keeps the best
    of its candidates. That order is never slower than 1F1B (each op starts no later; a B's
    successor waits for B alone, not B + W), so neither is zero-bubble, at the same in-flight
    bound. Its bubble need not shrink with every extra micro-batch at other ratios (p=5,
    f=2.5, b=w=2.84: 0.2173 at m=5, 0.2202 at m=6)."""
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
                          [float(k) for k in peak], peak)


# ---- closed forms, and what they answer -----------------------------------------------------
def check_shape(schedule, p, m, v, names=("stages", "microbatches", "chunks"),
                 limits=(MAX_STAGES, MAX_MICROBATCHES), divisible=True):
    """(p, m, v) checked for `schedule` (m None: not given); messages use `names`.
    divisible=False: interleaved 1F1B takes any m >= p (Megatron-Core since 2024 groups the
    micro-batches and lets the last group be short), not only multiples of p."""
    validate.choice("schedule", schedule, SCHEDULES)
    p = validate.positive_int(names[0], p, limits[0])
    m = None if m is None else validate.positive_int(names[1], m, limits[1])
    v = validate.positive_int(names[2], v, limits[0])
    if schedule in V_SCHEDULES:
        if v not in (1, 2):
            raise ValueError(f"{names[2]}={v}: {schedule} places 2 chunks on each rank (a V); "
                             f"allowed: 2, or leave {names[2]} out")
        if schedule == "dualpipev" and m is not None and m < 2 * p:
            raise ValueError(f"{names[1]}={m} is fewer than the {2 * p} stages of dualpipev on "
                             f"{names[0]}={p} ranks (torch's ScheduleDualPipeV needs at least one "
                             f"micro-batch per stage); allowed: {2 * p} or more")
        return p, m, 2
    if schedule != "interleaved-1f1b" and v != 1:
        raise ValueError(f"{names[2]}={v} needs schedule='interleaved-1f1b'; allowed for "
                         f"{schedule!r}: 1")
    if schedule == "interleaved-1f1b" and m is not None and not divisible and m < p:
        raise ValueError(f"{names[1]}={m} is fewer than {names[0]}={p}: interleaved-1f1b needs "
                         f"at least one micro-batch per stage; allowed: {p} or more")
    if schedule == "interleaved-1f1b" and m is not None and divisible and m % p:
        raise ValueError(f"{names[1]}={m} must be a multiple of {names[0]}={p} for "
                         "interleaved-1f1b (as in Megatron-LM); allowed: "
                         + ", ".join(str(p * k) for k in range(1, 5)) + ", ...")
    return p, m, v


FORMULA_NAMES = ("p", "m", "v")
FORMULA_LIMITS = (validate.MAX_LAYERS, validate.MAX_BATCH)


def _units(schedule, p, m, v) -> tuple[int, int]:
    """(bubble, work) of a stage in the same time unit: one micro-batch's (f + b) on a stage
    (f = b = w for zero-bubble); interleaving makes the unit 1/v of it, zero-bubble 1/3."""
    if schedule == "interleaved-1f1b":
        return p - 1, v * m
    if schedule == "zero-bubble":         # with m < p, stage 0's last W cannot hide: p - m more
        return p - 1 + max(0, p - m), 3 * m
    if schedule in V_SCHEDULES:           # unit: one chunk's pass, f/2 (labkit.pipeline_v)
        return v_units(schedule, p, m)
    return p - 1, m


def bubble_formula(schedule, p, m, v=1, divisible=True) -> tuple[float, float]:
    """(idle share of the step, bubble relative to the ideal time) in closed form, with equal
    times on every stage and free sends (p2p = 0), as `simulate` reproduces:
    - "gpipe" (Huang et al. 2019) and "1f1b" (Narayanan et al. 2021, §2.2): the same bubble,
      (p - 1)/(m + p - 1) of the step, (p - 1)/m relative to m (f + b). 1F1B bounds memory.
    - "interleaved-1f1b" (Narayanan et al. 2021, §2.2.1): divided by v: (p - 1)/(v m)
      relative, (p - 1)/(v m + p - 1) of the step (m a multiple of p).
    - "zero-bubble" (ZB-H1, Qi et al. 2024, §3.1) at T_F = T_B = T_W and m >= p:
      (p - 1)/(3 m) relative, (p - 1)/(3 m + p - 1) of the step, a third of 1F1B's at the same
      f + b + w. With m < p the last weight gradients cannot fill the gaps: the step takes
      2 (m + p - 1) + 1 units, (2 p - 1 - m)/(3 m) relative.
    - "zbv" (Qi et al. 2024, §6) at T_F = T_B = T_W, on p ranks: (p - 1)/(6 m) relative for
      m >= (3p - 1)/2 (the (p - 1) chunk forwards by which the last rank starts late; the
      paper's zero is the idle inside each rank's span, `paper_bubble`); fewer micro-batches
      (4p - 2 - 2m)/(6m). "dualpipev" (m >= 2p): (p - 1)/(3 m), as ZB-H1 (`v_units`).
    divisible=False: interleaved with any m >= p (`check_shape`), the same closed form."""
    p, m, v = check_shape(schedule, p, m, v, FORMULA_NAMES, FORMULA_LIMITS, divisible)
    bubble, work = _units(schedule, p, m, v)
    return bubble / (work + bubble), bubble / work


def min_microbatches(p, target, schedule="1f1b", v=1, relative=False) -> int:
    """The fewest micro-batches m whose bubble (`bubble_formula`) is at most `target`: the idle
    share of the step, or with relative=True the bubble relative to the ideal time. For
    interleaved 1F1B, m is a multiple of p. E.g. p=8 and 10 % of the step: m = 63."""
    from fractions import Fraction

    p, _, v = check_shape(schedule, p, None, v, FORMULA_NAMES, FORMULA_LIMITS)
    # the target as written (0.12 is 3/25, not the binary float just below it), so a bubble of
    # exactly the target meets it
    t = Fraction(repr(float(validate.at_least("target", target, 1e-6, 1e6 if relative else 1.0))))
    step = p if schedule == "interleaved-1f1b" else 1

    def meets(m):
        bubble, work = _units(schedule, p, m, v)
        return Fraction(bubble, work if relative else work + bubble) <= t

    # bubble b, work k m: b / (k m) <= t (relative) or b / (k m + b) <= t <=> k m >= b(1-t)/t;
    # b is its value for many micro-batches: a lower bound for zero-bubble at m < p and zbv at
    # m < (3p - 1)/2 (their bubble is larger there), exact otherwise
    b, k = _units(schedule, p, validate.MAX_BATCH, v)[0], _units(schedule, p, 1, v)[1]
    need = b / (k * t) if relative else b * (1 - t) / (k * t)
    m = -(-max(1, -(-need.numerator // need.denominator)) // step) * step
    if schedule == "dualpipev":           # torch's ScheduleDualPipeV: m >= 2p
        m = max(m, 2 * p)
    if m > validate.MAX_BATCH:
        raise ValueError(f"target={target!r} needs {m:,} micro-batches for p={p} (more than "
                         f"{validate.show(validate.MAX_BATCH)}); allowed: a larger target")
    while not meets(m):                   # zero-bubble below m = p only: at most p steps
        m += step
    return m


def activation_in_flight(schedule, p, m, v=1, divisible=True) -> list[float]:
    """Micro-batches whose activations each stage holds at its peak (what `simulate` counts):
    GPipe all m; 1F1B and zero-bubble (ZB-H1 keeps 1F1B's bound) min(p - i, m) on stage i;
    interleaved 1F1B, in micro-batches of the whole stage (chunks / v), Megatron-LM's warm-up of
    2 (p - i - 1) + (v - 1) p chunk forwards plus one, at most m v; at m = p all m v (labkit
    follows pre-2024 Megatron-LM there, see `_order`); zbv and dualpipev, in micro-batches of
    a rank's two chunks, half of `v_peak_chunks`. divisible: as `bubble_formula`."""
    from labkit.memory import in_flight

    p, m, v = check_shape(schedule, p, m, v, FORMULA_NAMES, FORMULA_LIMITS, divisible)
    if schedule in V_SCHEDULES:
        return [k / 2 for k in v_peak_chunks(schedule, p, m)]
    if schedule == "interleaved-1f1b":
        total = m * v
        return [(total if m == p else min(2 * (p - i - 1) + (v - 1) * p + 1, total)) / v
                for i in range(p)]
    base = "gpipe" if schedule == "gpipe" else "1f1b"
    return [float(in_flight(i, p, m, base)) for i in range(p)]


def activation_memory(model, schedule, p, m, v=1, **memory_kw) -> list[float]:
    """Activation bytes each stage holds at its peak: `labkit.memory.estimate_memory`'s bytes
    per micro-batch on stage i (its layers, the embedding on the first, the logits on the last)
    times `activation_in_flight`. The bytes per micro-batch are the difference of two
    estimates with GPipe (which holds all m) at m = 2 and m = 1: everything else cancels.
    Interleaved: each chunk counted as 1/v of its stage's bytes. zbv, dualpipev: the bytes of
    the 2p stages (estimates at pp = 2p), rank r holding `v_peak_chunks` chunks of the mean of
    its stages r and 2p - 1 - r (so the logits' bytes land on rank 0, which holds the last
    stage). memory_kw: estimate_memory's batch_size, seq_len, precision, tp, ... (not pp,
    microbatches, schedule)."""
    from labkit.memory import estimate_memory

    taken = {"pp", "microbatches", "schedule"} & set(memory_kw)
    if taken:
        raise ValueError(f"{sorted(taken)[0]}= is set by p, m and schedule; allowed in "
                         "memory_kw: estimate_memory's other arguments (batch_size, seq_len, ...)")
    held = activation_in_flight(schedule, p, m, v)
    v = 2 if schedule in V_SCHEDULES else v
    if v > 1 and not isinstance(model, (int, float)):
        from labkit.models import get_model

        n = get_model(model).num_layers
        if p * v > n:
            raise ValueError(f"p x v = {p * v} virtual stages is more than num_layers={n}; "
                             f"allowed: p x v up to {n} (a chunk holds one layer at least)")
    pp = 2 * p if schedule in V_SCHEDULES else p
    one, two = (estimate_memory(model, pp=pp, microbatches=k, schedule="gpipe", **memory_kw)
                for k in (1, 2))
    each = [b - a for a, b in zip(one.per_stage, two.per_stage)]
    if schedule in V_SCHEDULES:
        return [(each[r] + each[pp - 1 - r]) / 2 * k
                for r, k in enumerate(v_peak_chunks(schedule, p, m))]
    return [b * k for b, k in zip(each, held)]


@dataclass(frozen=True)
class P2PMessages:
    busiest_rank: int     # sends per step of the rank that sends most
    total: int            # sends per step over all ranks: 2 m (p v - 1)
    per_microbatch: int   # the busiest rank's sends per micro-batch


def p2p_messages(p, m, v=1, v_shape=False) -> P2PMessages:
    """Point-to-point sends of one step: activations forward and their gradients backward, at
    every boundary between virtual stages (`labkit.comm.step_communication("pp", chunks=v)`'s
    count). Interleaving multiplies a middle rank's sends by v (each micro-batch crosses it v
    times); the data-parallel all-reduce does not change. v_shape: the V placement of zbv and
    dualpipev (2 chunks a rank): the boundary at the V's tip stays on rank p - 1, so 2m(2p - 2)
    sends in all, 4 a micro-batch on a middle rank."""
    from labkit.comm import _pp_sends_per_rank

    p, v = (validate.positive_int(k, x, validate.MAX_LAYERS) for k, x in (("p", p), ("v", v)))
    m = validate.positive_int("m", m, validate.MAX_BATCH)
    if p * v > validate.MAX_LAYERS:
        raise ValueError(f"p x v = {p * v:,} virtual stages; allowed: up to "
                         f"{validate.MAX_LAYERS:,} (one layer each at least)")
    if v_shape:
        each = max(2 * ((r != p - 1) + (r != 0)) for r in range(p))
        return P2PMessages(each * m, 2 * m * (2 * p - 2), each)
    each = _pp_sends_per_rank(p, v) if p > 1 else 0
    return P2PMessages(each * m, 2 * m * (p * v - 1), each)


def check_schedule(actions, stages, microbatches):
    """`labkit.pipeline_check.check_schedule` (imported when called: it imports torch)."""
    from labkit.pipeline_check import check_schedule as check

    return check(actions, stages, microbatches)


def simulate_schedule(actions, fwd=1.0, bwd=2.0, wgrad=None, p2p=0.0) -> PipelineResult:
    """`labkit.pipeline_check.simulate_schedule` (imported when called: it imports torch)."""
    from labkit.pipeline_check import simulate_schedule as run

    return run(actions, fwd, bwd, wgrad, p2p)
