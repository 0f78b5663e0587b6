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

import json
import os
import runpy
import sys
import time
import traceback

from labkit.runtime import dist, guard


ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"   # torchrun: 0, then 1, 2, ... after each restart
_LAB_SUFFIX = ".lab"      # where a lab's own @record writes (see _private_error_file)


def _private_error_file() -> str | None:
    """Point a lab's own `@record` (torch elastic's error file) at a private path, so that the
    file torchrun's agent reads is only ever whole: `_write_elastic_error_file` moves it there
    in one rename. Returns the agent's path (None: not under torchrun or the pool).

    Why: torchrun's agent reads every failed rank's error file when it stops the others, and a
    rank it stopped (SIGTERM) halfway through writing one (`@record` writes in place) left an
    empty file that made the agent crash (json.decoder.JSONDecodeError) instead of printing its
    failure summary, which holds the ranks' exit codes (labkit.runtime.verdict reads them)."""
    path = os.environ.get(ERROR_FILE)
    if path:
        os.environ[ERROR_FILE] = path + _LAB_SUFFIX
    return path


def _write_elastic_error_file(exc: BaseException, path: str | None) -> None:
    """torch elastic's error file for this rank at `path` (what `@record` writes: the agent
    puts its traceback in torchrun's failure summary), whole or not at all: the lab's own, if
    its `@record` wrote a readable one, else ours; written aside, then renamed."""
    if not path or os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        try:
            with open(path + _LAB_SUFFIX, encoding="utf-8") as f:
                json.load(f)                 # the lab's own @record got there first
            os.replace(path + _LAB_SUFFIX, path)
            return
        except (OSError, ValueError):
            pass
        data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                            "extraInfo": {"py_callstack": "".join(
                                traceback.format_exception(type(exc), exc, exc.__traceback__)),
                                "timestamp": str(int(time.time()))}}}
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except Exception:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _ask_peers_where_they_are(exc: BaseException, tb: str) -> None:
    """This rank gave up waiting in a collective (its timeout): before it exits, and the
    launcher's agent stops the others, have the peers that are still running dump their stacks
    into the run directory, so that the launcher can name the rank that never joined
    (labkit.runtime.verdict). Waits up to postmortem.STACK_WAIT_SECONDS."""
    directory = os.environ.get(dist.ENV_RESULTS_DIR)
    if not directory or dist.world_size() < 2:
        return
    try:
        from labkit.runtime import postmortem
        if postmortem.timed_out_collective(str(exc), tb):
            postmortem.dump_peer_stacks(directory, dist.rank(), os.environ.get(dist.ENV_RUN_ID))
    except Exception:           # a diagnosis, never a reason to fail differently
        pass


def _record_attempt() -> None:
    """Under `torchrun --max-restarts N` the agent restarts every local rank after one dies,
    and the new processes append to the same rank<R>.jsonl: an "attempt" record (written
    before the start record, so that no record of the new attempt precedes it) opens the
    records of restart k (TORCHELASTIC_RESTART_COUNT), and the launcher judges the last attempt
    (labkit.runtime.verdict.split_attempts). Attempt 0 writes none: a run that never restarts
    leaves the records it always did."""
    try:
        attempt = int(os.environ.get(RESTART_COUNT, "0"))
    except ValueError:
        return
    if attempt > 0:
        dist._write({"kind": "attempt", "attempt": attempt, "pid": os.getpid()})


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
    error_file = _private_error_file()
    _record_attempt()
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
        _ask_peers_where_they_are(exc, tb)
        _write_elastic_error_file(exc, error_file)
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
