"""`%%torchrun`: run a notebook cell as a lab on several ranks (`%load_ext labkit` first).

    %%torchrun -n 4 --timeout 60
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)                 # dist is torch.distributed
    report(sum=x.item())               # -> _torchrun.results[rank]
    print0("sum over ranks:", x.item())

The cell runs in fresh processes, not in the kernel: it sees none of the notebook's variables.
What it is given, and what it returns: `TorchrunMagics.torchrun`.
"""
from __future__ import annotations

import os
import tempfile

from IPython.core.magic import Magics, cell_magic, magics_class
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


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(TorchrunMagics)
