"""`--trace DIR` of the labs: a few extra steps profiled with torch.profiler (CPU activity, CUDA
too on a GPU), one trimmed Chrome trace per rank, DIR/{lab}-{variant}-rank{r}.json, that
labkit.trace.summarize reads. Each file carries a "labkit" key with what the lab measured over
the same steps (wall seconds per step, collectives per step), so the trace can be checked.

    path = trace_steps(ctx, args.trace, "ddp", "torch", lambda: train_step(model, opt, ids))

`trim` and `dumps` (also used by tools/record_*trace*.py): the complete ("X") events and the
thread names, only the args labkit.trace needs; compact JSON but for the header, which HTA reads.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

WAIT, WARMUP, ACTIVE = 1, 1, 2      # profiler schedule: skipped, profiled but dropped, kept
KEEP_ARGS = ("External id", "Sequence number")


def trim(trace: dict, labkit: dict | None = None) -> dict:
    """`trace` (export_chrome_trace's JSON) without what labkit.trace never reads: complete
    events and thread-name metadata kept, each event's args cut to KEEP_ARGS; `labkit` added."""
    keep = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" or (e.get("ph") == "M" and e.get("name") == "thread_name"):
            e = dict(e)
            e["args"] = {k: v for k, v in e.get("args", {}).items()
                         if k in KEEP_ARGS or e["ph"] == "M"}
            keep.append(e)
    return {"distributedInfo": trace.get("distributedInfo"), "displayTimeUnit": "ms",
            "labkit": labkit or {}, "traceEvents": keep}


def dumps(trace: dict) -> str:
    """`trace` as JSON: the events without spaces, the header (distributedInfo, labkit) with
    them, as torch writes it: HTA finds a file's rank with the regex '"rank":\\s+(\\d+)'."""
    head = json.dumps({k: v for k, v in trace.items() if k != "traceEvents"})
    events = json.dumps(trace["traceEvents"], separators=(",", ":"))
    head = head[:-1] + ", " if len(head) > 2 else "{"
    return f'{head}"traceEvents": {events}}}'


def trace_path(folder, lab: str, variant: str, rank: int) -> Path:
    return Path(folder) / f"{lab}-{variant}-rank{rank}.json"


@contextlib.contextmanager
def _kineto_quiet():
    """File descriptor 2 to /dev/null: torch's profiler (Kineto) writes a "USDT: ...
    profiler_start" / "profiler_stop" line there, from C++, each time a recording starts or
    stops; a lab's output is no place for them. Only around the profiler's own calls."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def trace_steps(ctx, folder, lab: str, variant: str, step, *, active: int = ACTIVE,
                extra: dict | None = None) -> str | None:
    """Call `step()` WAIT + WARMUP + `active` times under torch.profiler and write this rank's
    trimmed trace of the `active` last ones (ProfilerStep windows); its path, or None (and no
    step run) when `folder` is None. Every rank calls it with the same steps. The collectives
    are counted (measure.CollectiveCounter) in the warm-up step, which the profiler records but
    drops, so the counter's dispatch overhead stays out of the kept steps. `extra`: more entries
    for the file's "labkit" key (what the lab planned, e.g. all-reduces per step)."""
    if folder is None:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from labkit.labs.common.training import barrier, synchronize
    from labkit.runtime import measure

    path = trace_path(folder, lab, variant, ctx.rank)
    raw = path.with_name(f".{path.stem}.raw.json")
    activities = [ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    counter, times = measure.CollectiveCounter(), []
    barrier(ctx)
    prof = profile(activities=activities, schedule=schedule(wait=WAIT, warmup=WARMUP, active=active),
                   on_trace_ready=lambda prof: prof.export_chrome_trace(str(raw)))
    with _kineto_quiet():
        prof.start()
    try:
        for i in range(WAIT + WARMUP + active):
            t = time.perf_counter()
            with counter if i == WAIT else contextlib.nullcontext():
                step()
            synchronize(ctx.device)
            if i >= WAIT + WARMUP:
                times.append(time.perf_counter() - t)
            with _kineto_quiet():
                prof.step()
    finally:
        with _kineto_quiet():
            prof.stop()
    by_kind = counter.by_kind
    ops: dict = {}
    for c in counter.events:
        name = c.op.replace(".", "::", 1)
        ops[name] = ops.get(name, 0) + 1
    info = dict(lab=lab, variant=variant, rank=ctx.rank, world=ctx.world_size,
                backend=ctx.backend, device=str(ctx.device), torch=torch.__version__,
                steps=active, step_s=times,
                collectives_per_step={k: n for k, (n, _) in by_kind.items()},
                bytes_per_step={k: b for k, (_, b) in by_kind.items()},
                ops_per_step=dict(sorted(ops.items())), **(extra or {}))
    try:
        trace = json.loads(raw.read_text())
    finally:
        raw.unlink(missing_ok=True)
    path.write_text(dumps(trim(trace, info)))
    if ctx.rank == 0:
        every = trace_path(folder, lab, variant, 0).name.replace("rank0", f"rank{{0..{ctx.world_size - 1}}}")
        print(f"profiler trace of {active} step(s), one file per rank: {Path(folder) / every}",
              flush=True)
    return str(path)


def check_folder(parser, folder) -> None:
    """parser.error unless a lab can write its traces in `folder` (made if missing)."""
    from labkit.labs.common.flags import unwritable

    if folder is not None and (why := unwritable(folder)):
        parser.error(f"argument --trace: {why}; allowed: a folder this user can write "
                     "(made if missing)")
