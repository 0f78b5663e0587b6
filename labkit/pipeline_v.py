"""V-shaped pipeline schedules: ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism" §6)
and DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 report §3.2.1 and github.com/deepseek-ai/DualPipe),
each rank's order of passes as torch 2.13 builds it (ScheduleZBVZeroBubble, ScheduleDualPipeV:
tests/cost/test_pp_torch_order.py checks they are equal), in pure Python.

    >>> zbv_orders(4, 8)[0][:3]       # rank 0: [(("F", 0, 0),), (("F", 1, 0),), ...]

p ranks hold 2p stages in a V: rank r holds stage r (chunk 0) and 2p - 1 - r (chunk 1), so rank
0 holds the first and the last. A step is a tuple of passes (kind, micro-batch, stage) as
`labkit.pipeline_events.run_orders` takes them; "BW" is a full backward (torch's B).
"""
from __future__ import annotations


def v_place(p: int) -> dict[int, tuple[int, int]]:
    """{stage: (rank, chunk)} of the V placement of 2p stages on p ranks."""
    return {s: (s, 0) if s < p else (2 * p - 1 - s, 1) for s in range(2 * p)}


def zbv_orders(p: int, m: int) -> list[list[tuple]]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations for every rank: a warm-up of
    2(p - r) - 1 chunk-0 forwards, then r pairs F1 F0, then p - r times F1 I1 W1; a steady
    F0 I0 W0 F1 I1 W1; a cool-down of input gradients with weight gradients deferred. torch
    plans at least 2p - 1 micro-batches and drops the passes of those beyond m."""
    orders = []
    n = max(2 * p - 1, m)
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        o = []
        f0 = f1 = b0 = b1 = 0

        def add(kind, mb, stage):
            o.append((kind, mb, stage))

        for _ in range(2 * (p - r) - 1):
            add("F", f0, s0)
            f0 += 1
        for _ in range(r):
            add("F", f1, s1)
            f1 += 1
            add("F", f0, s0)
            f0 += 1
        for _ in range(p - r):
            add("F", f1, s1)
            f1 += 1
            add("B", b1, s1)
            add("W", b1, s1)
            b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                add("F", f0, s0)
                f0 += 1
            add("B", b0, s0)
            add("W", b0, s0)
            b0 += 1
            add("F", f1, s1)
            f1 += 1
            add("B", b1, s1)
            add("W", b1, s1)
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            add("B", b0, s0)
            b0 += 1
            add("B", b1, s1)
            b1 += 1
        for _ in range(p - r):
            add("B", b0, s0)
            b0 += 1
            add("W", w0, s0)
            w0 += 1
        o += [("W", j, s1) for j in range(w1, b1)] + [("W", j, s0) for j in range(w0, b0)]
        orders.append([(op,) for op in o if op[1] < m])
    return orders


def dualpipev_orders(p: int, m: int) -> list[list[tuple]]:
    """ScheduleDualPipeV._calculate_single_rank_operations for every rank (m >= 2p, as torch
    requires): 1. 2(p - r - 1) chunk-0 forwards; 2. r + 1 pairs F0 F1; 3. p - r - 1 times I1 W
    F1; 4. m - 2p + r + 1 times the overlapped pairs (F0; B1) and (F1; B0) (on the last rank
    the first (F0; B1) is not overlapped: F0 then B1); 5. p - r - 1 times B1 (F1; B0); 6. r + 1
    pairs B1 B0, input gradients alone (I) from half way; 7. p - r - 1 times W B0; 8. the
    deferred W. B here is a full backward ("BW"); W passes come from a queue of the I's."""
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        o: list[tuple] = []
        count: dict = {}
        wq: list = []

        def take(stage, kind):
            j = count.get((stage, kind), 0)
            count[(stage, kind)] = j + 1
            return j

        def act(stage, kind):             # F, I (queues its W) or BW (I and W together)
            j = take(stage, "F" if kind == "F" else "I")
            if kind == "I":
                wq.append((stage, j))
            return (kind if kind != "I" else "B", j, stage)

        def w():
            if wq:
                stage, j = wq.pop(0)
                o.append((("W", j, stage),))

        def pair(fs, bs):
            o.append((act(fs, "F"), act(bs, "BW")))

        for _ in range(2 * (p - r - 1)):
            o.append((act(s0, "F"),))
        for _ in range(r + 1):
            o += [(act(s0, "F"),), (act(s1, "F"),)]
        for _ in range(p - r - 1):
            o.append((act(s1, "I"),))
            w()
            o.append((act(s1, "F"),))
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:
                o += [(act(s0, "F"),), (act(s1, "BW"),)]
            else:
                pair(s0, s1)
            pair(s1, s0)
        for _ in range(p - r - 1):
            o.append((act(s1, "BW"),))
            pair(s1, s0)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            o.append((act(s1, "I" if split else "BW"),))
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            o.append((act(s0, "I" if split else "BW"),))
        for _ in range(p - r - 1):
            w()
            o.append((act(s0, "I" if split else "BW"),))
        for _ in range(r + 1):
            w()
        orders.append(o)
    return orders


# ---- closed forms (f = b = w unless said), in units of one chunk's pass T = f/2 -------------
def v_units(schedule: str, p: int, m: int) -> tuple[int, int]:
    """(bubble, work) of a rank in units of one chunk's pass (f = b = w, free sends), as
    `labkit.pipeline.simulate` gives them: work 6 m (F, I, W of 2 chunks). ZB-V: max(p - 1,
    4p - 2 - 2m): rank r starts r passes late and, with m >= (3p - 1)/2, never idles after
    (the paper's "zero bubble" is that idle inside each rank's span, `paper_bubble`); fewer
    micro-batches leave 2 passes idle per missing one. DualPipeV (m >= 2p): 2 (p - 1), the
    DeepSeek formula with F&B = F + B (torch runs the pair one pass after the other)."""
    if schedule == "zbv":
        return max(p - 1, 4 * p - 2 - 2 * m), 6 * m
    return 2 * (p - 1), 6 * m


def v_peak_chunks(schedule: str, p: int, m: int) -> list[int]:
    """Micro-batch chunks each rank holds at its peak (forwarded, not yet through I or B):
    ZB-V min(2p, m + 1 + r, 2m) on rank r, 2p (1F1B's p micro-batches of a whole rank's
    layers, as Qi et al. §6 say) once m >= 2p - 1; DualPipeV 2p + 1 on every rank (the
    DualPipe README's PP + 1 for PP = 2p stages; the overlapped pair holds its forward's
    new chunk while its backward runs)."""
    if schedule == "zbv":
        return [min(2 * p, m + 1 + r, 2 * m) for r in range(p)]
    return [2 * p + 1] * p


def paper_bubble(schedule: str, p: int, fwd: float, bwd: float, wgrad: float) -> float:
    """Idle time of the busiest rank inside its own span (first pass to last), as the papers
    state it, with fwd, bwd (input gradient alone), wgrad the passes of a rank's whole share:
    1F1B (p - 1)(F + B), ZB-H1 (p - 1)(F + B - 2W) with B the full backward (the DualPipe
    README's table); ZB-V (p - 1)(T_F + T_B - 2 T_W) per chunk (Qi et al. 2024, §6; zero at
    equal times); DualPipeV (PP/2 - 1)(F&B + B - 3W) per chunk, PP = 2p stages, F&B = F + B
    as torch runs it. `simulate` agrees at f = b = w (and 1F1B always); other ratios differ."""
    f, b, w = fwd, bwd, wgrad
    if schedule == "1f1b":
        return (p - 1) * (f + b + w)
    if schedule == "zero-bubble":
        return (p - 1) * (f + (b + w) - 2 * w)
    if schedule == "zbv":
        return (p - 1) * (f + b - 2 * w) / 2
    F, B, W = f / 2, (b + w) / 2, w / 2
    return (p - 1) * ((F + B) + B - 3 * W)
