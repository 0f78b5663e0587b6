"""`%%torchrun`: run a notebook cell on fresh ranks; `%ranks`/`%%ranks`: on ranks that stay
(labkit.runtime.world), names kept between cells (`%load_ext labkit` first).

    %%torchrun -n 4 --timeout 60
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)                 # dist is torch.distributed
    report(sum=x.item())               # -> _torchrun.results[rank]
    %ranks start -n 4                  # then, in any cell:  %%ranks   or   %%ranks 0,2

A cell runs in the ranks, not in the kernel: it sees none of the notebook's variables.
What each is given and returns: `TorchrunMagics.torchrun`, `RanksMagics.ranks_cell`.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring


@magics_class
class TorchrunMagics(Magics):
    @magic_arguments()
    @argument("-n", "--nproc", type=int, default=None,
              help="ranks to start (default: one per GPU, else min(4, cores) but at least 2)")
    @argument("--timeout", type=float, default=120.0,
              help="seconds before every rank is stopped (default 120)")
    @argument("--backend", choices=["gloo", "nccl"], default=None,
              help="default: NCCL when each rank has a GPU, else gloo")
    @argument("--quiet", action="store_true", help="do not stream the ranks' output")
    @argument("--launcher", choices=["auto", "pool", "torchrun"], default=None,
              help="pool: fork the ranks from a warm process (fast, one machine); torchrun: "
                   "python -m torch.distributed.run; default: LABKIT_LAUNCHER, else auto")
    @cell_magic
    def torchrun(self, line, cell):
        """Run this cell on N ranks (see labkit.runtime.magic).

        The cell runs in fresh processes (forked from the warm pool, or under torchrun with
        `--launcher torchrun`), not in the kernel: it sees none of the notebook's variables, and
        it starts with labkit.runtime.dist set up and these names defined: rank, world_size,
        device, ctx (labkit.runtime.dist.Context), report, print0, progress, torch, dist
        (torch.distributed). Output is streamed into the cell with a rank prefix; the LabResult
        is returned and also stored in the notebook variable `_torchrun`. A failing rank raises
        labkit.runtime.launch.LabError."""
        from labkit.runtime.launch import run_lab

        opts = parse_argstring(self.torchrun, line)
        env = {"LABKIT_CELL_SETUP": "1"}
        if opts.backend:
            env["LABKIT_BACKEND"] = opts.backend
        with tempfile.TemporaryDirectory(prefix="labkit-cell-") as tmp:
            path = os.path.join(tmp, "torchrun_cell.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write(cell)
            result = run_lab(path, nproc=opts.nproc, timeout=opts.timeout, env=env,
                             quiet=opts.quiet, launcher=opts.launcher)
        self.shell.user_ns["_torchrun"] = result
        return result


def parse_ranks(text: str | None, nproc: int) -> list[int] | None:
    """"0,2", "1-3", "0,2-3" or "all" -> ranks (None: all)."""
    if text is None or text.strip() in ("", "all"):
        return None
    out = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UsageError(f"%%ranks {text}: not a list of ranks; allowed: e.g. 0,2 or 1-3 or all "
                         f"(ranks 0 to {nproc - 1})") from None
    bad = sorted(r for r in out if not 0 <= r < nproc)
    if bad or not out:
        raise UsageError(f"%%ranks {text}: rank(s) {bad} are not in this world of {nproc}; "
                         f"allowed: 0 to {nproc - 1}")
    return sorted(out)


@magics_class
class RanksMagics(Magics):
    @magic_arguments()
    @argument("action", choices=["start", "stop", "restart", "status"])
    @argument("-n", "--nproc", type=int, default=None,
              help="ranks to start (default: one per GPU, else min(4, cores) but at least 2)")
    @argument("--backend", choices=["gloo", "nccl"], default=None,
              help="default: NCCL when each rank has a GPU, else gloo")
    @argument("--device", choices=["cpu", "cuda"], default=None,
              help="where each rank's `device` is (default: cuda under NCCL, else cpu)")
    @argument("--timeout", type=float, default=None,
              help="seconds a cell may run before its ranks are diagnosed and started again "
                   "(default 60)")
    @argument("--launcher", choices=["auto", "pool", "torchrun"], default=None,
              help="as %%%%torchrun's (default: the warm pool on Linux)")
    @line_magic("ranks")
    def ranks_line(self, line):
        """%ranks start|stop|restart|status: ranks that stay between cells (see %%ranks).

        `%ranks start -n 4` starts 4 ranks with an initialised process group (the variables
        torchrun gives); run again with the same options it keeps them, with others it starts
        new ones. `stop` ends them (a kernel restart, shutdown or kill -9 does too);
        `restart` starts them afresh; `status` shows each rank's pid, memory and last cell."""
        from labkit.runtime import ranks_view, world
        opts = parse_argstring(self.ranks_line, line)
        w = world.current()
        if opts.action == "status":
            print(ranks_view.status_text(w))
            return None
        if opts.action == "stop":
            if w is None or w.job is None:
                print("no ranks are running")
            else:
                w.stop()
                print(f"stopped {w.nproc} ranks; nothing of them is left running")
            world.set_current(None)
            return None
        if opts.action == "restart":
            if w is None:
                raise UsageError("no ranks to restart; start them with `%ranks start -n 4`")
            t0 = time.monotonic()
            w.restart(show=ranks_view.PlainLines())
            print(f"started again: {w.options()} in {time.monotonic() - t0:.1f} s")
            return None
        asked = dict(nproc=opts.nproc, backend=opts.backend, device=opts.device,
                     timeout=60.0 if opts.timeout is None else opts.timeout,
                     launcher=opts.launcher)
        if w is not None and w.job is not None and w.alive and _same(w, asked):
            print(f"already running: {w.options()} (`%ranks restart` starts them afresh)")
            return None
        if w is not None:
            w.stop()
        try:
            w = world.World(**asked)
        except ValueError as exc:
            raise UsageError(f"%ranks start: {exc}") from None
        t0 = time.monotonic()
        w.start(show=ranks_view.PlainLines())
        world.set_current(w)
        pids = ", ".join(f"{r}: {p}" for r, p in sorted(w.pids.items()))
        print(f"started {w.options()} in {time.monotonic() - t0:.1f} s (pids {pids})")
        return None

    @magic_arguments()
    @argument("ranks", nargs="?", default=None,
              help="the ranks to run the cell on: 0,2 or 1-3 (default: all)")
    @argument("--timeout", type=float, default=None,
              help="seconds before the cell is diagnosed and the ranks started again "
                   "(default: %%ranks start's)")
    @argument("--no-count", action="store_true",
              help="do not count collectives (their counter sees every tensor operation)")
    @cell_magic("ranks")
    def ranks_cell(self, line, cell):
        """Run this cell on the ranks of `%ranks start` (all, or those named: `%%ranks 0,2`).

        Names a cell defines stay on its ranks for the next %%ranks cell. Each cell starts with
        rank, world_size, device, ctx, torch, dist (torch.distributed), report and print0.
        Output comes back live, per rank; under it, each rank's time, collectives (count and
        bytes per kind) and peak memory. The value of the last line on each rank is returned
        (and kept in `_ranks`: `_ranks[r]`; `_ranks_cell` has the rest). A rank that raises
        shows its traceback and the ranks stay; a cell past its timeout says where each rank
        waits, and the ranks are started again."""
        from labkit.runtime import ranks_view, world
        opts = parse_argstring(self.ranks_cell, line)
        w = world.current()
        if w is None or w.job is None:
            raise UsageError("no ranks are running: start them with `%ranks start -n 4` first")
        ranks = parse_ranks(opts.ranks, w.nproc)
        view = ranks_view.live_view(ranks or list(range(w.nproc)))
        try:
            result = w.run(cell, ranks, opts.timeout, count=not opts.no_count, show=view)
        except world.RanksError as exc:
            view.finish(exc.cell)
            if exc.cell is not None:
                self._keep(exc.cell)
            raise
        except KeyboardInterrupt:
            view.finish(None)
            raise
        view.finish(result)
        self._keep(result)
        return result.values if result.values else None

    def _keep(self, result) -> None:
        self.shell.user_ns["_ranks"] = result.values
        self.shell.user_ns["_ranks_cell"] = result
        notes: dict[str, list[int]] = {}
        for r in result.ranks:
            if (why := result.by_rank[r].value_error):
                notes.setdefault(why, []).append(r)
        for why, rs in notes.items():
            print(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {why}",
                  file=sys.stderr)


def _same(w, asked: dict) -> bool:
    from labkit.runtime import system
    nproc = system.default_nproc() if asked["nproc"] is None else asked["nproc"]
    return (w.nproc, w.backend, w.device, w.timeout, w.launcher) == (
        nproc, asked["backend"], asked["device"], asked["timeout"], asked["launcher"])


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(TorchrunMagics)
    ipython.register_magics(RanksMagics)
