"""Bandwidth lab: time all_reduce, all_gather and reduce_scatter over a sweep of message sizes,
print an nccl-tests-like table, fit t = alpha + beta * S to each op, and save a plot.

    python -m labkit.labs.collectives                        # 1 process: nothing sent
    torchrun --nproc-per-node 4 -m labkit.labs.collectives   # 4 ranks: gloo, NCCL if each has a GPU
    torchrun --nproc-per-node 4 -m labkit.labs.collectives -b 1K -e 64M -f 2 -n 20
    labkit run collectives -n 4 -- --sizes 4K,1M,16M         # via labkit
    labkit bench collectives                                 # the default sweep
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 -m labkit.labs.collectives -e 1G        # two nodes

Conventions: nccl-tests' (doc/PERFORMANCE.md); the table, the fit: docs/labs.md, ## collectives."""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from labkit.labs.common.flags import parse_size, unwritable
from labkit.labs.common.wire import bytes_written, fit_alpha_beta, model_parameters

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# Not the current directory: a sweep started from a repository must not leave files in it.
DEFAULT_PLOT = "auto"      # a new private directory (mkdtemp, mode 0700) per run


def save_plot(data: bytes, where: str) -> str:
    """Write the PNG to `where` ("auto": collectives.png in a new private temporary directory,
    never a fixed shared path another user could plant a symlink at). A given path is written
    without following a symlink at its last component."""
    if where == DEFAULT_PLOT:
        where = os.path.join(tempfile.mkdtemp(prefix="labkit-collectives-"), "collectives.png")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(where, flags, 0o644)
    except OSError as exc:
        raise ValueError(f"--plot={where!r}: cannot write the plot there ({exc.strerror}; a "
                         "symbolic link is refused); allowed: a regular file path, 'auto' or ''") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return os.path.abspath(where)


def plot_problem(where: str) -> str | None:
    """Why save_plot could not write `where` (checked before the sweep), or None."""
    if where in (DEFAULT_PLOT, ""):
        return None
    if os.path.isdir(where):
        return (f"{where!r} is a folder; allowed: a file path such as "
                f"{os.path.join(where, 'collectives.png')!r}, 'auto' or ''")
    if os.path.islink(where):
        return f"{where!r} is a symbolic link; allowed: a regular file path, 'auto' or ''"
    why = unwritable(os.path.dirname(where) or ".", create=False)
    return f"{why}; allowed: a file path in a folder you can write, 'auto' or ''" if why else None


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float, world_size: int,
                elem_size: int) -> list[int]:
    """min, min*f, ... up to max, each rounded up to a whole number of elements per rank chunk
    (S must split into N equal chunks for all_gather and reduce_scatter)."""
    if max_bytes < min_bytes:
        raise ValueError(f"max size {max_bytes} B is below min size {min_bytes} B")
    if factor <= 1:
        raise ValueError(f"step factor {factor} must be > 1")
    quantum = world_size * elem_size
    sizes, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        q = int(math.ceil(s / quantum) * quantum)
        if not sizes or q > sizes[-1]:
            sizes.append(q)
        s *= factor
    return sizes


def nccl_count(op: str, nbytes: int, elem_size: int, world_size: int) -> int:
    """The count column of nccl-tests for a buffer of S = `nbytes`: the count argument of the
    call, i.e. S in elements for all_reduce, S / N in elements for all_gather (each rank's
    input) and reduce_scatter (each rank's output)."""
    count = nbytes // elem_size
    return count // world_size if op in ("all_gather", "reduce_scatter") else count



# ---------------------------------------------------------------------------------------------
# inside a rank


def _collective(op: str):
    import torch.distributed as tdist

    if op == "all_reduce":
        return lambda out, inp: tdist.all_reduce(inp)
    if op == "all_gather":
        fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
        return lambda out, inp: fn(out, inp)
    if op == "reduce_scatter":
        fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
        return lambda out, inp: fn(out, inp)
    raise ValueError(f"op={op!r} is not supported; allowed: {', '.join(OPS)}")


def _buffers(op, nbytes, world_size, rank, dtype, device):
    """(out, inp) for one call; inp is filled with rank + 1 so results can be checked."""
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    count = nbytes // elem
    if op == "all_reduce":
        inp = torch.full((count,), rank + 1.0, dtype=dtype, device=device)
        return inp, inp
    if op == "all_gather":
        inp = torch.full((count // world_size,), rank + 1.0, dtype=dtype, device=device)
        return torch.empty(count, dtype=dtype, device=device), inp
    inp = torch.full((count,), rank + 1.0, dtype=dtype, device=device)
    return torch.empty(count // world_size, dtype=dtype, device=device), inp


def _wrong(op, out, world_size) -> int:
    import torch

    total = world_size * (world_size + 1) / 2
    if op == "all_gather":
        chunks = out.view(world_size, -1)
        expected = torch.arange(1, world_size + 1, dtype=out.dtype, device=out.device)[:, None]
        return int((chunks != expected).sum())
    return int((out != total).sum())


def measure(op, nbytes, iters, warmup, ctx, dtype):
    """One row: check, warm up, time `iters` calls; time averaged over ranks."""
    import torch
    import torch.distributed as tdist

    call = _collective(op)
    out, inp = _buffers(op, nbytes, ctx.world_size, ctx.rank, dtype, ctx.device)
    call(out, inp)
    wrong = _wrong(op, out, ctx.world_size)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call(out, inp)
    sync()
    tdist.barrier()
    w0 = bytes_written()
    t0 = time.perf_counter()
    for _ in range(iters):
        call(out, inp)
    sync()
    elapsed = (time.perf_counter() - t0) / iters
    w1 = bytes_written()
    # gloo moves bytes through this process's sockets; NCCL (GPU) does not write() them
    sent = (w1 - w0) / iters if (w0 is not None and ctx.backend == "gloo") else None
    t = torch.tensor([elapsed, float(wrong)], dtype=torch.float64, device=ctx.device)
    tdist.all_reduce(t)
    return t[0].item() / ctx.world_size, int(t[1].item()), sent


HEADER = ("#{:>11} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>6} {:>8}".format(
    "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "sent/S") + "\n" +
    "#{:>11} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>6} {:>8}".format(
        "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "rank 0"))


def format_row(row: dict) -> str:
    sent = f"{row['sent'] / row['size']:.3f}" if row.get("sent") is not None else "-"
    return "{:>12} {:>12} {:>8} {:>6} {:>10.1f} {:>8.3f} {:>8.3f} {:>6} {:>8}".format(
        row["size"], row["count"], row["type"], row["redop"], row["time"] * 1e6,
        row["algbw"] / 1e9, row["busbw"] / 1e9, row["wrong"], sent)


def format_fit(op: str, world_size: int, fit: dict) -> str:
    m = model_parameters(op, world_size, fit)
    if m["steps"] == 0:
        return (f"# fit {op}: t = {fit['alpha'] * 1e6:.1f} us + {fit['beta']:.3g} s/B (one rank: "
                "nothing is sent, this is the cost of a local call)")
    return (f"# fit {op}: t = {fit['alpha'] * 1e6:.1f} us + S / {1 / fit['beta'] / 1e9:.3f} GB/s"
            f"  (rms rel. err {fit['rms_rel_err']:.0%}); as the ring model: latency "
            f"{m['latency'] * 1e6:.1f} us x {m['steps']:g} steps, link {m['bandwidth'] / 1e9:.3f}"
            " GB/s per direction (= busbw at large S)" if fit["beta"] > 0 else
            f"# fit {op}: t = {fit['alpha'] * 1e6:.1f} us + {fit['beta']:.3g} s/B (no bandwidth "
            "term: sizes too small?)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Sweep collective sizes; nccl-tests-like table and "
                                "an alpha-beta fit.")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated, from {', '.join(OPS)} (default: all three)")
    p.add_argument("-b", "--min-bytes", default="1K", help="smallest size (default 1K = 1024 B)")
    p.add_argument("-e", "--max-bytes", default="16M",
                   help="largest size (default 16M: a few seconds on a laptop)")
    p.add_argument("-f", "--step-factor", type=float, default=4.0,
                   help="multiply the size by this between rows (default 4)")
    p.add_argument("--sizes", default=None,
                   help="explicit comma-separated sizes instead of -b/-e/-f, e.g. 4K,1M,8M")
    p.add_argument("-n", "--iters", type=int, default=10,
                   help="timed calls per size (default 10; the mean is reported)")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls first (default 2)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--plot", default=DEFAULT_PLOT,
                   help="where rank 0 saves the plot (default 'auto': a new private temporary "
                        "directory; '' for none)")
    args = p.parse_args(argv)
    try:
        ops = [o for o in args.ops.split(",") if o]
        for o in ops:
            if o not in OPS:
                raise ValueError(f"--ops: {o!r} is not supported; allowed: {', '.join(OPS)}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        explicit = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        lo, hi = parse_size(args.min_bytes), parse_size(args.max_bytes)
        if hi < lo and not explicit:
            raise ValueError(f"--max-bytes: {args.max_bytes} is below --min-bytes "
                             f"{args.min_bytes}; allowed: a size >= --min-bytes")
        if not args.step_factor > 1 and not explicit:
            raise ValueError(f"--step-factor: {args.step_factor} is not > 1; allowed: a number "
                             "> 1 (e.g. 2)")
        if os.environ.get("RANK", "0") == "0" and plot_problem(args.plot):   # rank 0 saves it
            raise ValueError(f"--plot: {plot_problem(args.plot)}")
    except ValueError as exc:
        p.error(str(exc))

    import torch
    from labkit.runtime import dist
    from labkit.comm import bus_bandwidth

    ctx = dist.setup()
    dtype = getattr(torch, args.dtype)
    elem = DTYPES[args.dtype]
    n = ctx.world_size
    if explicit:
        quantum = n * elem
        sizes = sorted({int(math.ceil(s / quantum) * quantum) for s in explicit})
    else:
        sizes = sweep_sizes(lo, hi, args.step_factor, n, elem)

    dist.print0(f"# labkit.labs.collectives: {n} ranks, backend {ctx.backend}, {args.dtype}, "
                f"{args.iters} iterations after {args.warmup} warm-up")
    rows, sent_mine = [], []
    for op in ops:
        dist.print0(f"#\n# {op}\n{HEADER}")
        for size in sizes:
            t, wrong, sent = measure(op, size, args.iters, args.warmup, ctx, dtype)
            row = dict(op=op, size=size, count=nccl_count(op, size, elem, n), type=args.dtype,
                       redop="none" if op == "all_gather" else "sum", time=t, algbw=size / t,
                       busbw=bus_bandwidth(op, size, t, n), wrong=wrong, sent=sent)
            sent_mine.append(sent)
            rows.append(row)
            dist.print0(format_row(row))
    fits = {}
    for op in ops:
        mine = [r for r in rows if r["op"] == op]
        if len(mine) >= 2:
            fits[op] = fit_alpha_beta([r["size"] for r in mine], [r["time"] for r in mine])
            fits[op].update(model_parameters(op, n, fits[op]))
    dist.print0("#")
    for op, fit in fits.items():
        dist.print0(format_fit(op, n, fit))
    wrong_total = sum(r["wrong"] for r in rows)
    dist.print0(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")

    dist.report(sent=sent_mine)
    if ctx.is_main:
        dist.report(rows=rows, fits=fits, world_size=n, backend=ctx.backend, plot=None)
        if args.plot:
            from labkit.plots import png_bytes
            from labkit.plots.comm import bench_figure
            saved = save_plot(png_bytes(bench_figure(rows, fits)), args.plot)
            dist.report(plot=saved)
            dist.print0(f"# plot saved to {saved}")
    if wrong_total:
        sys.stdout.flush()
        raise SystemExit(f"{wrong_total} wrong elements: the collectives returned bad results")
    dist.shutdown()


if __name__ == "__main__":
    main()
