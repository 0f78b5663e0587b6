"""Inside a rank: set up the process group, report results to the launcher, shut down cleanly.

    from labkit.runtime import dist
    ctx = dist.setup()                 # backend, device, seed, collective timeout
    ...                                # the lab, using torch.distributed as usual
    dist.report(loss=loss.item())      # goes to result.results[rank] in the notebook
    dist.shutdown()                    # barrier, flush, exit (see `shutdown` for why)

The same under `run_lab`, under a plain `torchrun` (one node or several) and as a single process
(`python -m labkit.labs.hello`: world size 1). How reports reach the launcher: `_write`.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import socket
import sys
import time
import traceback as _traceback
from dataclasses import dataclass

from labkit.runtime import system

# Environment variables shared with labkit.runtime.launch (the launcher sets them for every rank).
ENV_RUN_ID = "LABKIT_RUN_ID"                    # marks every process of one run (teardown, tests)
ENV_RESULTS_DIR = "LABKIT_RESULTS_DIR"          # where ranks write their JSON-lines records
ENV_COLLECTIVE_TIMEOUT = "LABKIT_COLLECTIVE_TIMEOUT"  # seconds; the launcher sets it above its own
ENV_BACKEND = "LABKIT_BACKEND"                  # gloo | nccl, overrides the automatic choice
ENV_RANK_LAUNCHER = "LABKIT_RANK_LAUNCHER"      # "pool" in a rank the warm pool started

# A collective that waits longer than this raises instead of hanging. torch's default is 30 min;
# a lab on a laptop that waits 5 minutes in one all-reduce is broken, not slow.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0

_T0 = time.time()          # start of this rank (the bootstrap imports us first thing)
_MODULES_AT_START = set(sys.modules)
_reports: list[dict] = []  # what report() was given, also when no launcher listens
_finished = False
_ctx: "Context | None" = None


@dataclass(frozen=True)
class Context:
    """Who this rank is: what `setup()` returns."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: "object"  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ---------------------------------------------------------------------------------------------
# identity (from the torchrun environment; valid before and after setup). run_lab's ranks, a
# plain torchrun's and a multi-node run's all carry the usual variables (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT); without them this is a single process of
# world size 1.

def rank() -> int:
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def under_torchrun() -> bool:
    """Started by torchrun or by labkit's pool launcher (which sets the same variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launcher() -> str | None:
    """"pool" (labkit's warm pool), "torchrun", or None (a plain process)."""
    if os.environ.get(ENV_RANK_LAUNCHER):
        return os.environ[ENV_RANK_LAUNCHER]
    return "torchrun" if under_torchrun() else None


# ---------------------------------------------------------------------------------------------
# setup

def setup(backend: str | None = None, *, seed: int | None = 0, timeout: float | None = None,
          device: str | None = None) -> Context:
    """Initialise torch.distributed for this rank and return its `Context`.

    backend: None picks NCCL when every local rank has a GPU of its own, else gloo on CPU
        (`labkit.runtime.system.default_backend`); LABKIT_BACKEND=gloo|nccl overrides the choice.
    seed: seeds torch, random (and numpy if present) with `seed` on every rank, so replicas
        start identical; None leaves the generators alone.
    timeout: seconds a collective may wait before raising (default: LABKIT_COLLECTIVE_TIMEOUT,
        which the launcher sets just above its own timeout, else 300 s).
    device: None means cuda:LOCAL_RANK under NCCL and cpu under gloo.
    Calling setup() twice returns the same context.
    """
    global _ctx
    import torch
    import torch.distributed as tdist

    if _ctx is not None and tdist.is_initialized():
        return _ctx
    if backend is None:
        backend = system.default_backend(local_world_size())
    from labkit.validate import choice, positive
    choice("backend", backend, ("gloo", "nccl"))
    if timeout is None:
        timeout = float(os.environ.get(ENV_COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT))
    timeout = positive("timeout", timeout)

    if "MASTER_ADDR" not in os.environ:   # a single process, started without torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(system.free_port()),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")

    if device is None:
        device = f"cuda:{local_rank()}" if backend == "nccl" else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy
            numpy.random.seed(seed)
        except ImportError:
            pass

    if not tdist.is_initialized():
        kwargs = {}
        if dev.type == "cuda":
            kwargs["device_id"] = dev   # eager NCCL init: errors surface here, not mid-lab
        tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **kwargs)
    _ctx = Context(rank=tdist.get_rank(), world_size=tdist.get_world_size(),
                   local_rank=local_rank(), local_world_size=local_world_size(),
                   backend=tdist.get_backend(), device=dev)
    return _ctx


def context() -> Context:
    """The context of the last `setup()` (raises if setup was not called)."""
    if _ctx is None:
        raise RuntimeError("labkit.runtime.dist.setup() has not been called in this rank")
    return _ctx


# ---------------------------------------------------------------------------------------------
# reporting

def _jsonable(value):
    """Tensors and numpy values become numbers/lists; anything else unknown becomes its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):            # torch.Tensor, numpy arrays and scalars
        return _jsonable(value.tolist())
    if hasattr(value, "_asdict"):
        return _jsonable(value._asdict())
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses
        return _jsonable(dataclasses.asdict(value))
    return repr(value)


def _write(record: dict) -> None:
    """Append one JSON-lines record to `rank<R>.jsonl` in the directory LABKIT_RESULTS_DIR names:
    the channel to the launcher (start, report, progress, error, exit records). Files, not
    stdout markers, because lab output may be anything and a line written with flush survives a
    rank that is killed a moment later. Without the variable (plain torchrun) nothing is written:
    reports are kept in `reported()` and printed by nobody."""
    directory = os.environ.get(ENV_RESULTS_DIR)
    if not directory:
        return
    record = {"time": time.time(), **record}
    line = json.dumps(record) + "\n"
    # One write of one line, opened for append: a rank killed right after still leaves whole lines.
    with open(os.path.join(directory, f"rank{rank()}.jsonl"), "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def report(**metrics) -> None:
    """Send metrics to the launcher: `result.results[rank]` is the union of this rank's reports
    (a later value of a key replaces an earlier one). Tensors are converted with `.tolist()`."""
    metrics = _jsonable(metrics)
    _reports.append(metrics)
    _write({"kind": "report", "metrics": metrics})


def reported() -> dict:
    """The union of what this rank has reported so far."""
    merged: dict = {}
    for m in _reports:
        merged.update(m)
    return merged


def progress(step: int, total: int | None = None, **metrics) -> None:
    """Print one progress line on rank 0 ("step 3/10  loss 2.3100") and record it on every rank."""
    _write({"kind": "progress", "step": step, "total": total, "metrics": _jsonable(metrics)})
    if rank() == 0:
        shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in metrics.items())
        of = f"/{total}" if total is not None else ""
        print(f"step {step}{of}  {shown}".rstrip(), flush=True)


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# lifecycle records (written by labkit.runtime.bootstrap, which wraps every lab run_lab starts)

def _begin() -> None:
    directory = os.environ.get(ENV_RESULTS_DIR)
    if directory:
        # On SIGUSR1 dump every thread's Python stack, so that a launcher timeout (or a peer
        # whose collective timed out) can say where each rank was stuck. faulthandler writes
        # from the signal handler in C, which works even while the rank blocks inside a
        # gloo/NCCL call. Registered before the start record is written: whoever reads this
        # rank's pid there may send SIGUSR1 at once (its default action ends the process).
        import faulthandler
        import signal
        f = open(os.path.join(directory, f"rank{rank()}.stack"), "w")  # noqa: SIM115 (kept open)
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    _write({"kind": "start", "rank": rank(), "local_rank": local_rank(),
            "world_size": world_size(), "pid": os.getpid(), "host": socket.gethostname()})


def _record_error(exc: BaseException) -> str:
    te = _traceback.TracebackException.from_exception(exc)
    # Drop the launcher's own frames (bootstrap, runpy): the traceback starts in the lab.
    kept = [f for f in te.stack if not f.filename.endswith(("labkit/runtime/bootstrap.py", "runpy.py"))
            and not f.filename.startswith("<frozen runpy")]
    te.stack = _traceback.StackSummary.from_list(kept)
    tb = "".join(te.format())
    _write({"kind": "error", "exc_type": type(exc).__name__,
            "message": str(exc), "traceback": tb})
    return tb


def _finish(code: int) -> None:
    global _finished
    if not _finished:
        _finished = True
        record = {"kind": "exit", "code": code, "wall_time": time.time() - _T0}
        if rank() == 0 and os.environ.get(ENV_RANK_LAUNCHER) == "pool":
            # what this lab imported from installed packages (transformers, torch's own
            # submodules, ...): the warm pool imports them too, ahead of the next lab
            record["modules"] = _installed_modules_imported()
        _write(record)


def _installed_modules_imported() -> list[str]:
    """Modules imported since this rank started that live in site-packages (never labkit's
    or the learner's code, which must be imported fresh by every lab), in import order."""
    out = []
    for name in list(sys.modules):
        if name in _MODULES_AT_START or name.split(".")[0] in ("labkit", "__main__"):
            continue
        path = getattr(sys.modules[name], "__file__", None) or ""
        if "site-packages" in path or "dist-packages" in path:
            out.append(name)
    return out


def shutdown(exit_process: bool | None = None, wait: bool = True) -> None:
    """End this rank cleanly: barrier, destroy the process group, flush output, exit.
    wait=False skips the barrier: for a rank that stops early (an error) while its peers may
    still wait in an exchange with it, which then fails on them when this process is gone.

    Why exit with os._exit(0): in 10-40% of 4-process runs that build a DeviceMesh, a rank
    aborts at interpreter exit (SIGABRT, "terminate called without an active exception") after
    its work is done, and torchrun reports the lab as failed. Skipping interpreter teardown
    avoids it. exit_process defaults to True under torchrun and False in a plain process (so a
    notebook or a test calling shutdown() is not killed).
    """
    global _ctx
    import torch.distributed as tdist

    if exit_process is None:
        exit_process = under_torchrun()
    if tdist.is_initialized():
        try:
            if wait and tdist.get_world_size() > 1:
                tdist.barrier()
            tdist.destroy_process_group()
        except Exception as exc:  # a peer already gone: nothing to wait for
            print(f"labkit.runtime.dist.shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
    _ctx = None
    if exit_process:
        _finish(0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
