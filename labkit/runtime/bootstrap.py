"""What each rank runs under `labkit.runtime.launch.run_lab`: `python -m labkit.runtime.bootstrap TARGET ARGS...`.

It runs TARGET (a module such as `labkit.labs.hello`, or a script path) as `__main__`, and around
it writes the records the launcher reads (start with pid, exit with wall time, error with the
exception type, message and traceback) and torch elastic's error file, so that every lab gets
the behaviour of `@record` whether or not its author remembered it. A lab whose process group is
still up when it returns is shut down by `labkit.runtime.dist.shutdown()` (barrier, flush, os._exit).

LABKIT_CELL_SETUP=1 (the %%torchrun magic) calls `labkit.runtime.dist.setup()` first and gives the
script the names rank, world_size, device, ctx, report, print0, progress, torch and dist
(torch.distributed).
"""
from __future__ import annotations

import os
import runpy
import sys

from labkit.runtime import dist, guard


def _write_elastic_error_file(exc: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):   # the lab's own @record got there first
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(exc)
    except Exception:
        pass


def _cell_globals() -> dict:
    import torch
    import torch.distributed
    ctx = dist.setup()
    return dict(torch=torch, dist=torch.distributed, ctx=ctx, rank=ctx.rank,
                world_size=ctx.world_size, device=ctx.device, report=dist.report,
                print0=dist.print0, progress=dist.progress)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m labkit.runtime.bootstrap TARGET [ARGS...]")
    target, args = argv[0], argv[1:]
    guard.protect_rank()          # die with torchrun and with the launcher (no orphans)
    dist._begin()
    sys.argv = [target, *args]
    code = 0
    try:
        init = _cell_globals() if os.environ.get("LABKIT_CELL_SETUP") == "1" else None
        if target.endswith(".py") or os.path.sep in target:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, init_globals=init, run_name="__main__")
        else:
            runpy.run_module(target, init_globals=init, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code != 0:
            dist._record_error(exc)
    except BaseException as exc:
        tb = dist._record_error(exc)
        _write_elastic_error_file(exc)
        dist._finish(1)
        # Print the traceback without this module's frames, then leave at once: peers are
        # already failing, and interpreter teardown with a live process group can abort.
        sys.stderr.write(tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if code == 0 and "torch.distributed" in sys.modules:
        import torch.distributed as tdist
        if tdist.is_initialized():
            dist.shutdown()          # does not return under torchrun
    dist._finish(code)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
