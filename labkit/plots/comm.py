"""Pictures for module 02 (collectives): who holds what before and after each collective, the
ring all-reduce step by step, and collective time against message size (with the latency-bound
and bandwidth-bound regions).

The pictures are symbolic: rank r starts with data x_r (split into chunks x_r0, x_r1, ... where
the collective works on chunks). They are drawn from small state tables built here
(`holdings`, `ring_all_reduce_steps`), which the tests compare with what real ranks hold. Times
come from `labkit.comm.collective_time`; no cost formula lives in this module.
"""
from __future__ import annotations

from labkit.plots import new_figure

# One colour per rank (colour-blind-safe Okabe-Ito palette); sums of several ranks are grey,
# darker the more ranks they contain.
RANK_COLOURS = ["#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#0072B2", "#D55E00", "#F0E442",
                "#999999"]
EMPTY = "#FFFFFF"

OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "send_recv")


_LONG = (("years", 365.25 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60))


def fmt_time(t: float) -> str:
    """'28.0 µs', '1.25 ms', '3.500 s'; from 2 minutes on also in the largest unit that fits
    ('7,200 s (2.0 hours)'); tiny ones in powers of ten ('1.00e-15 s', not '0.0 µs')."""
    if t < 1e-7:
        return f"{t:.2e} s"
    if t < 1e-3:
        return f"{t * 1e6:,.1f} µs"
    if t < 1:
        return f"{t * 1e3:,.2f} ms"
    if t < 120:
        return f"{t:,.3f} s"
    unit, size = next((u, n) for u, n in _LONG if t >= 2 * n)
    return f"{t:,.0f} s ({t / size:,.1f} {unit})"


def fmt_size(n: float) -> str:
    """A size as a person reads it, decimal and binary: '16.78 MB (16.00 MiB)'."""
    for unit, dec, binary, bunit in (("GB", 1e9, 2**30, "GiB"), ("MB", 1e6, 2**20, "MiB"),
                                     ("kB", 1e3, 2**10, "KiB")):
        if n >= dec:
            return f"{n / dec:,.2f} {unit} ({n / binary:,.2f} {bunit})"
    return f"{n:,.0f} B"


# ---------------------------------------------------------------------------------------------
# who holds what

def holdings(op: str, world_size: int = 4):
    """(before, after) for `op` on `world_size` ranks: for each rank, a list of cells; a cell is
    a frozenset of (source rank, chunk) pairs summed in it (empty: nothing defined there).

    Chunk -1 means "the whole tensor" of that rank. Root/destination is rank 0; send/recv sends
    from rank 0 to rank 1. After `reduce`, the non-destination ranks' buffers are not defined by
    the API (gloo happens to leave partial sums there), so they are drawn empty.
    """
    n = world_size
    whole = [[frozenset({(r, -1)})] for r in range(n)]
    chunks = [[frozenset({(r, c)}) for c in range(n)] for r in range(n)]
    nothing = frozenset()
    if op == "broadcast":
        before = [[frozenset({(0, -1)})]] + [[nothing] for _ in range(1, n)]
        after = [[frozenset({(0, -1)})] for _ in range(n)]
    elif op == "reduce":
        before = whole
        after = [[frozenset((r, -1) for r in range(n))]] + [[nothing] for _ in range(1, n)]
    elif op == "all_reduce":
        before = whole
        after = [[frozenset((r, -1) for r in range(n))] for _ in range(n)]
    elif op == "all_gather":
        before = whole
        # the gathered tensor (N times the input): slot j holds rank j's input
        after = [[frozenset({(j, -1)}) for j in range(n)] for _ in range(n)]
    elif op == "reduce_scatter":
        before = chunks
        after = [[frozenset((j, r) for j in range(n))] for r in range(n)]
    elif op == "all_to_all":
        before = chunks
        after = [[frozenset({(j, r)}) for j in range(n)] for r in range(n)]
    elif op == "send_recv":
        before = [[frozenset({(0, -1)})]] + [[nothing] for _ in range(1, n)]
        after = [[frozenset({(0, -1)})], [frozenset({(0, -1)})]] + [[nothing] for _ in range(2, n)]
    else:
        raise ValueError(f"op={op!r} is not supported; allowed: {', '.join(OPS)}")
    return before, after


def _label(cell) -> str:
    if not cell:
        return ""
    if len(cell) == 1:
        (r, c), = cell
        return f"x{r}" if c < 0 else f"x{r}{c}"
    chunks = {c for _, c in cell}
    ranks = sorted(r for r, _ in cell)
    inner = "x" if chunks == {-1} else f"x·{chunks.pop()}"
    return f"Σ{inner}" if len(ranks) > 3 else "+".join(
        (f"x{r}" if c < 0 else f"x{r}{c}") for r, c in sorted(cell))


FULL_SUM = "#1F3A93"   # a chunk that holds every rank's contribution


def _colour(cell, world_size: int) -> str:
    if not cell:
        return EMPTY
    if len(cell) == 1:
        (r, _), = cell
        return RANK_COLOURS[r % len(RANK_COLOURS)]
    if len({r for r, _ in cell}) == world_size:
        return FULL_SUM
    shade = 0.88 - 0.3 * (len(cell) - 2) / max(1, world_size - 2)
    return str(round(shade, 3))   # a matplotlib grey level


def _draw_grid(ax, rows, world_size: int, title: str, arrows=(), label=None, ncols=None):
    """Rows are ranks (rank 0 on top), columns are slots/chunks of each rank's buffer.

    arrows: (src, dst, chunk): a red arrow from src's cell to dst's cell of that chunk, and a red
    outline on the receiving cell; the ring's wrap-around (last rank -> rank 0) is drawn as an
    arrow leaving the bottom and one entering the top, so that no arrow crosses the grid."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    label = label or _label
    ncols = ncols or max(len(r) for r in rows)
    received = {(dst, chunk) for _, dst, chunk in arrows}
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            hot = (r, c) in received
            ax.add_patch(Rectangle((c, -r - 0.9), 0.92, 0.8, facecolor=_colour(cell, world_size),
                                   edgecolor="#B00020" if hot else "#333333",
                                   linewidth=2.0 if hot else 0.8))
            text = label(cell)
            if text:
                dark = _colour(cell, world_size) == FULL_SUM
                ax.text(c + 0.46, -r - 0.5, text, ha="center", va="center",
                        fontsize=7 if len(text) > 6 else 8, color="white" if dark else "black")
        ax.text(-0.15, -r - 0.5, f"rank {r}", ha="right", va="center", fontsize=8)

    def arrow(p, q):
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=8, color="#B00020",
                                     lw=1.1, shrinkA=0, shrinkB=0))

    for src, dst, chunk in arrows:
        x = chunk + 0.2
        if dst == src + 1:
            arrow((x, -src - 0.75), (x, -dst - 0.25))
        else:   # wrap-around
            arrow((x, -src - 0.75), (x, -src - 1.25))
            arrow((x, 0.35), (x, -dst - 0.25))
    ax.set_xlim(-1.3, ncols + 0.1)
    ax.set_ylim(-len(rows) - 0.35, 0.45)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


def holdings_figure(ops=OPS, world_size: int = 4, per_row: int = 2):
    """What each rank holds before and after each collective: a (before, after) pair of panels
    per op, `per_row` ops side by side. One cell is one rank's input tensor (or one chunk of it
    where the op works on chunks): all_gather's output is N cells long, reduce_scatter's one."""
    if isinstance(ops, str):
        ops = [ops]
    ops = list(ops)
    per_row = min(per_row, len(ops))
    nrows = -(-len(ops) // per_row)
    fig = new_figure(4.6 * per_row, (0.32 * world_size + 0.45) * nrows + 0.2)
    axes = fig.subplots(nrows, 2 * per_row, squeeze=False)
    flat = [a for row in axes for a in row]
    for ax in flat[2 * len(ops):]:
        ax.axis("off")
    for i, op in enumerate(ops):
        before, after = holdings(op, world_size)
        _draw_grid(flat[2 * i], before, world_size, f"{op}: before", ncols=world_size)
        _draw_grid(flat[2 * i + 1], after, world_size, f"{op}: after", ncols=world_size)
    return fig


# ---------------------------------------------------------------------------------------------
# ring all-reduce, step by step

def ring_all_reduce_steps(world_size: int = 4):
    """The ring all-reduce on `world_size` ranks as a list of steps.

    Each step is a dict: phase ("start", "reduce-scatter" or "all-gather"), step (1-based within
    its phase), sends [(src, dst, chunk)], and state: for each rank, for each chunk, the set of
    ranks whose contributions that chunk holds. The buffer is cut into N chunks; in
    reduce-scatter step s (0-based) rank r sends chunk (r - s) mod N to rank r+1, which adds it to
    its own; after N-1 steps rank r holds the full sum of chunk (r+1) mod N. In all-gather step s
    rank r sends chunk (r + 1 - s) mod N, which rank r+1 stores. Every step every rank sends one
    chunk (S/N bytes) and receives one: 2(N-1) steps, 2(N-1)/N * S bytes sent per rank.
    """
    n = world_size
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"world_size={n!r} must be a whole number >= 2")
    state = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    steps = [dict(phase="start", step=0, sends=[], state=[list(row) for row in state])]
    for s in range(n - 1):
        sends = [(r, (r + 1) % n, (r - s) % n) for r in range(n)]
        new = [list(row) for row in state]
        for src, dst, c in sends:
            new[dst][c] = state[dst][c] | state[src][c]
        state = new
        steps.append(dict(phase="reduce-scatter", step=s + 1, sends=sends,
                          state=[list(row) for row in state]))
    for s in range(n - 1):
        sends = [(r, (r + 1) % n, (r + 1 - s) % n) for r in range(n)]
        new = [list(row) for row in state]
        for src, dst, c in sends:
            new[dst][c] = state[src][c]
        state = new
        steps.append(dict(phase="all-gather", step=s + 1, sends=sends,
                          state=[list(row) for row in state]))
    return steps


def _ring_cells(state_row):
    # chunk c of a rank as (rank, chunk) pairs, to reuse the holdings drawing
    return [frozenset((r, c) for r in ranks) for c, ranks in enumerate(state_row)]


def _ring_label(world_size):
    def label(cell):
        ranks = sorted(r for r, _ in cell)
        return "Σ" if len(ranks) == world_size else "+".join(map(str, ranks))
    return label


def ring_steps_figure(world_size: int = 4, columns: int = 4):
    """One panel per step of the ring all-reduce (start, N-1 reduce-scatter steps, N-1
    all-gather steps). Columns are chunks; a cell lists the ranks whose contributions it holds.
    Arrows show the chunk each rank sent to its right neighbour in that step (the state drawn is
    after the step; red outlines mark the chunks just received); grey cells are partial sums
    (darker: more ranks summed), dark blue Σ a chunk that holds every rank's contribution."""
    steps = ring_all_reduce_steps(world_size)
    rows_n = -(-len(steps) // columns)
    fig = new_figure(2.6 * columns, 0.55 * world_size * rows_n + 0.5 * rows_n)
    axes = fig.subplots(rows_n, columns, squeeze=False)
    for i, ax in enumerate(a for row in axes for a in row):
        if i >= len(steps):
            ax.axis("off")
            continue
        st = steps[i]
        rows = [_ring_cells(row) for row in st["state"]]
        title = "start: x_r in N chunks" if st["phase"] == "start" else (
            f"{st['phase']} step {st['step']}/{world_size - 1}")
        # the arrow is drawn on the chunk after the step; its source row is the sender
        _draw_grid(ax, rows, world_size, title, arrows=st["sends"], label=_ring_label(world_size))
    return fig


# ---------------------------------------------------------------------------------------------
# time against message size

def _terms(op, world_size, bandwidth, latency, algorithm=None):
    """Latency term (intercept) and seconds per byte (slope) of the cost model, read off
    `collective_time` itself (it is affine in the message size), so no formula is copied here.
    The intercept is the time of an empty message and the slope that of a message at zero
    latency, not a difference of two times (which rounds to 0 when the latency term dwarfs the
    bandwidth term, or to a tiny negative intercept when there is no latency)."""
    from labkit.comm import collective_time

    kw = {} if algorithm is None else {"algorithm": algorithm}
    s1 = 2.0**20
    intercept = collective_time(op, nbytes=0.0, world_size=world_size, bandwidth=bandwidth,
                                latency=latency, **kw)
    return intercept, collective_time(op, nbytes=s1, world_size=world_size, bandwidth=bandwidth,
                                      latency=0.0, **kw) / s1


def crossover_bytes(op, world_size, bandwidth, latency, algorithm=None) -> float:
    """Message size at which the latency term equals the bandwidth term of the model."""
    intercept, slope = _terms(op, world_size, bandwidth, latency, algorithm)
    return intercept / slope if slope > 0 else float("inf")


def time_vs_size_figure(op, world_size, bandwidth, latency, *, algorithm=None, mark=None,
                        mark_label="your message", sizes=None, measured=None, title=None):
    """Predicted time of `op` against message size (log-log), with the latency-bound region
    (left of the crossover, shaded) and the bandwidth-bound region. `mark` (bytes) puts a dot on
    the curve, named `mark_label` in the legend; `measured` is {label: (sizes, seconds)} drawn
    as points on top."""
    from labkit.comm import collective_time

    kw = {} if algorithm is None else {"algorithm": algorithm}
    if sizes is None:
        sizes = [2.0**k for k in range(6, 35)]           # 64 B .. 16 GiB
    times = [collective_time(op, nbytes=s, world_size=world_size, bandwidth=bandwidth,
                             latency=latency, **kw) for s in sizes]
    intercept, slope = _terms(op, world_size, bandwidth, latency, algorithm)
    cross = intercept / slope if slope > 0 else float("inf")
    fig = new_figure(7.0, 3.6)
    ax = fig.add_subplot()
    ax.loglog(sizes, times, color="#0072B2", lw=2, label="model: α-term + β-term")
    if intercept > 0:
        ax.loglog(sizes, [intercept] * len(sizes), ls=":", color="#555555", lw=1,
                  label="latency term alone")
    ax.loglog(sizes, [slope * s for s in sizes], ls="--", color="#555555", lw=1,
              label="bandwidth term alone")
    lo, hi = sizes[0], sizes[-1]
    if lo < cross < hi:
        ax.axvspan(lo, cross, color="#E69F00", alpha=0.12)
        ax.axvline(cross, color="#E69F00", lw=1)
        ax.text(cross, max(times), f" terms equal at\n {fmt_size(cross)}", fontsize=7,
                va="top")
        ax.text((lo * cross) ** 0.5, min(times) * 1.6, "latency-bound", fontsize=8,
                color="#8a5a00", ha="center")
        if hi / cross > 8:
            ax.text((cross * hi) ** 0.5, min(times) * 1.6, "bandwidth-bound", fontsize=8,
                    color="#0b4f7a", ha="center")
    if mark is not None:
        tm = collective_time(op, nbytes=mark, world_size=world_size, bandwidth=bandwidth,
                             latency=latency, **kw)
        ax.plot([mark], [tm], "o", color="#B00020", zorder=5, label=mark_label)
    for i, (label, (xs, ys)) in enumerate((measured or {}).items()):
        ax.loglog(xs, ys, "x", ms=6, color=RANK_COLOURS[(i + 2) % len(RANK_COLOURS)],
                  label=label)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("time (s)")
    ax.set_title(title or f"{op} on {world_size} ranks", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    ax.set_ylim(bottom=min(min(times), *(min(ys) for _, ys in (measured or {}).values()))
                / 3 if measured else min(times) / 3)
    return fig


def bench_figure(rows, fits):
    """Measured time (points) and fitted alpha-beta line per op, and busbw against size.

    rows: dicts with op, size (bytes), time (s), busbw (bytes/s); fits: {op: {"alpha": s,
    "beta": s/byte}} where the fitted time is alpha + beta * size."""
    fig = new_figure(9.0, 3.6)
    ax_t, ax_b = fig.subplots(1, 2)
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for i, op in enumerate(ops):
        colour = RANK_COLOURS[i % len(RANK_COLOURS)]
        xs = [r["size"] for r in rows if r["op"] == op]
        ts = [r["time"] for r in rows if r["op"] == op]
        bb = [r["busbw"] / 1e9 for r in rows if r["op"] == op]
        ax_t.loglog(xs, ts, "o", color=colour, label=f"{op} measured")
        if op in fits:
            a, b = fits[op]["alpha"], fits[op]["beta"]
            lo, hi = min(xs), max(xs)
            grid = [lo * (hi / lo) ** (k / 60) for k in range(61)] if hi > lo else xs
            ax_t.loglog(grid, [a + b * x for x in grid], "-", color=colour, lw=1,
                        # the fitted line itself (intercept, slope), as the lab prints it; the
                        # ring model's α per step and B per direction are a reading of it
                        label=f"fit t = {a * 1e6:.0f} µs + S / {1 / b / 1e9:.2f} GB/s"
                        if b > 0 else f"fit t = {a * 1e6:.0f} µs")
        ax_b.semilogx(xs, bb, "o-", color=colour, label=op)
    ax_t.set_xlabel("size S (bytes)")
    ax_t.set_ylabel("time per collective (s)")
    ax_t.legend(fontsize=6)
    ax_t.grid(True, alpha=0.3)
    ax_b.set_xlabel("size S (bytes)")
    ax_b.set_ylabel("busbw (GB/s)")
    ax_b.legend(fontsize=7)
    ax_b.grid(True, alpha=0.3)
    return fig
