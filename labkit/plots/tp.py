"""Pictures for module 06 (tensor parallelism): what each rank holds, and the tensor-parallel
lab's measurements (labkit.labs.tp) beside their predictions.

    >>> fig = weight_split(tp=4)                  # A split by columns (column-parallel), B by rows
    >>> fig = heads_per_rank(num_heads=8, tp=4)   # attention: whole heads per rank
    >>> fig = mlp_flow(tp=2)                      # X -> f -> XA_r -> GeLU -> .B_r -> g (all-reduce)
    >>> r = run_lab("labkit.labs.tp", nproc=2, args=["--part", "dtensor"]).results[0]
    >>> fig = measured_bars(collective_rows(r))

Every number drawn comes from the arguments. No torch here (layer 2).
"""
from __future__ import annotations

from labkit import validate
from labkit.plots import new_figure

RANK_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
                "#8c8c8c")


def _tp(tp) -> int:
    return validate.positive_int("tp", tp, len(RANK_COLOURS))


def weight_split(tp: int = 2, rows: int = 4, cols: int = 8):
    """Two weight matrices (out x in, as nn.Linear stores them): the column-parallel layer's A
    split into tp blocks of output rows (each rank computes its slice of the output features),
    the row-parallel layer's B split into tp blocks of input columns (each rank takes its
    slice of the input features and produces a partial sum). Colour = the rank holding it."""
    from matplotlib.patches import Rectangle

    n = _tp(tp)
    rows, cols = validate.positive_int("rows", rows, 64), validate.positive_int("cols", cols, 64)
    validate.divides("tp", n, "rows", rows)
    validate.divides("tp", n, "cols", cols)
    fig = new_figure(8.0, 3.0)
    for k, (title, by_rows) in enumerate((("column-parallel A: rank r holds rows "
                                           "(output features)", True),
                                          ("row-parallel B: rank r holds columns "
                                           "(input features)", False))):
        ax = fig.add_subplot(1, 2, k + 1)
        for i in range(rows):
            for j in range(cols):
                rank = i * n // rows if by_rows else j * n // cols
                ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor=RANK_COLOURS[rank],
                                       edgecolor="white"))
        ax.set_xlim(0, cols)
        ax.set_ylim(0, rows)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("in_features")
        ax.set_ylabel("out_features")
        ax.set_title(title, fontsize=8)
    _rank_legend(fig, n)
    return fig


def heads_per_rank(num_heads: int = 8, tp: int = 2):
    """The attention heads in a row, coloured by the rank that computes them: the QKV
    projection is column-parallel by heads, so each rank holds num_heads/tp whole heads (their
    q, k and v) and runs attention on them alone; the output projection is row-parallel."""
    from matplotlib.patches import Rectangle

    n = _tp(tp)
    a = validate.positive_int("num_heads", num_heads, 256)
    validate.divides("tp", n, "num_heads", a)
    fig = new_figure(max(4.0, 0.5 * a), 1.8)
    ax = fig.subplots()
    for i in range(a):
        rank = i // (a // n)
        ax.add_patch(Rectangle((i, 0), 0.9, 1, facecolor=RANK_COLOURS[rank]))
        ax.text(i + 0.45, 0.5, f"h{i}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, a)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title(f"{a} heads over tp={n}: {a // n} whole heads per rank (q, k, v and their "
                 f"attention); no communication inside attention", fontsize=8)
    _rank_legend(fig, n)
    return fig


def mlp_flow(tp: int = 2, sequence_parallel: bool = False):
    """The MLP block as each rank runs it: X (whole) -> f -> X A_r (column-parallel) -> GeLU ->
    . B_r (row-parallel) -> g -> Y; the one all-reduce of the forward is g's (f's is in the
    backward). With sequence_parallel, f and g become an all-gather and a reduce-scatter of the
    sequence, and X and Y are this rank's sequence shard."""
    n = _tp(tp)
    validate.choice("sequence_parallel", sequence_parallel, (False, True))
    fig = new_figure(8.0, 0.9 + 0.7 * n)
    ax = fig.subplots()
    f_label = "all-gather (seq)" if sequence_parallel else "f (bwd: all-reduce)"
    g_label = "reduce-scatter (seq)" if sequence_parallel else "g: ALL-REDUCE"
    x_label = "X shard [s/tp]" if sequence_parallel else "X [s, b, h]"
    stages = [x_label, f_label, "X A_r", "GeLU", "(.) B_r", g_label,
              "Y shard" if sequence_parallel else "Y"]
    comm = {1, 5}
    for r in range(n):
        y = n - 1 - r
        for k, label in enumerate(stages):
            colour = "#c44e52" if k in comm else RANK_COLOURS[r]
            ax.text(k * 1.4, y, label, ha="center", va="center", fontsize=7, color="white",
                    bbox=dict(boxstyle="round", facecolor=colour, edgecolor="none"))
            if k:
                ax.annotate("", xy=(k * 1.4 - 0.5, y), xytext=(k * 1.4 - 0.9, y),
                            arrowprops=dict(arrowstyle="->", lw=0.8))
        ax.text(-1.0, y, f"rank {r}", ha="right", va="center", fontsize=7)
    for k in comm:
        ax.axvspan(k * 1.4 - 0.55, k * 1.4 + 0.55, color="#c44e52", alpha=0.12)
    ax.set_xlim(-1.8, 1.4 * (len(stages) - 1) + 0.8)
    ax.set_ylim(-0.7, n - 0.3)
    ax.axis("off")
    how = ("sequence parallel: the LayerNorm runs on the shard" if sequence_parallel else
           "column then row: no communication in between; one all-reduce forward (g), "
           "one backward (f)")
    ax.set_title(f"Megatron MLP on tp={n}: {how}", fontsize=8)
    return fig


def _rank_legend(fig, n: int) -> None:
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=RANK_COLOURS[r], label=f"rank {r}") for r in range(n)],
               fontsize=7, loc="outside lower center", ncol=n)


def collective_rows(report: dict) -> dict:
    """{label: (measured bytes, predicted bytes)} from a --part block or --part dtensor report
    (rank 0's): per collective kind, the layers' payload S beside step_communication("tp")."""
    if not isinstance(report, dict) or report.get("part") not in ("block", "dtensor"):
        raise ValueError("report: allowed: a labkit.labs.tp --part block or --part dtensor "
                         f"report (got {str(report)[:60]!r})")
    if report["part"] == "block":
        sp = " (SP)" if report["sequence_parallel"] else ""
        return {f"{k}{sp}": (report["collectives"].get(k, [0, 0])[1], p["bytes"])
                for k, p in report["predicted_collectives"].items()}
    return {f"{plan}: {k}": (p["layer_total"].get(k, [0, 0])[1], w["bytes"])
            for plan, p in report["plans"].items() for k, w in p["predicted_megatron"].items()}


def measured_bars(rows: dict, title: str = "", unit: str = "bytes"):
    """One pair of bars per row of {label: (measured, predicted)}, with measured/predicted
    written beside each pair (e.g. `collective_rows(report)`, or saved activations)."""
    if not isinstance(rows, dict) or not rows:
        raise ValueError("rows: allowed: a non-empty {label: (measured, predicted)} dict")
    for label, pair in rows.items():
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(v, (int, float)) and v >= 0 for v in pair)):
            raise ValueError(f"rows[{label!r}]={pair!r}: allowed: (measured, predicted), two "
                             "numbers >= 0")
    names = list(rows)
    fig = new_figure(7.0, 1.0 + 0.45 * len(names))
    ax = fig.subplots()
    ys = range(len(names))
    ax.barh([y - 0.2 for y in ys], [rows[k][0] for k in names], height=0.4,
            color="#4c72b0", label="measured")
    ax.barh([y + 0.2 for y in ys], [rows[k][1] for k in names], height=0.4,
            color="#dd8452", label="predicted")
    for y, k in zip(ys, names):
        m, p = rows[k]
        ax.text(max(m, p), y, f"  x{m / p:.3f}" if p else "  -", va="center", fontsize=7)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title or "measured vs predicted (ratio written beside)", fontsize=9)
    ax.legend(fontsize=7)
    return fig
