"""Record the course traces shipped in labkit/data/traces (the labs' --trace, see its README).

    python tools/record_course_traces.py          # rewrites labkit/data/traces/*.json

Runs labkit.labs.ddp (--part compare, --part straggler), labkit.labs.fsdp (--part timeline) and
labkit.labs.pp (--part byhand) with --trace into a temporary folder, then `compact`s a chosen
set into the package: the last profiled step only ("labkit" key's steps, step_s cut to it), no
per-event args, no op nested in an aten op or a communication event, no autograd node inside its
own "autograd::engine::evaluate_function: " span, times from the run's first event (all ranks of
a run: one origin). labkit.trace's compute, communication, exposed and idle times are unions of
intervals, so they are unchanged; top_ops' self times then include the dropped sub-ops.
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "labkit" / "data" / "traces"
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2"]
RUNS = (  # (lab, ranks, args, variants shipped)
    ("ddp", 2, [*SMALL[:6], "--seq", "128", "--batch", "8", "--part", "compare", "--steps", "5",
                "--bucket-mb", "0.1"],
     ("naive", "bucketed", "torch", "torch-onebucket")),
    ("ddp", 2, [*SMALL, "--part", "straggler", "--steps", "1", "--sleep", "0.05"], ("straggler",)),
    ("fsdp", 2, ["--part", "timeline", "--steps", "3", "--prefetch", "1"],
     ("prefetch0", "prefetch1")),
    ("pp", 4, ["--part", "byhand", "--layers", "4", "--microbatches", "4", "--sleep", "0.02",
               "--repeats", "1"], ("gpipe", "1f1b")),
)
LIMIT_BYTES = 2_500_000
EVALUATE = "autograd::engine::evaluate_function: "


def _nested(events: list[dict]) -> set[int]:
    """ids of the cpu ops (not communication) whose enclosing event on their thread is an aten
    op or a communication event: covered by it, so no union of intervals changes without them."""
    from labkit import trace

    drop, threads = set(), {}
    for e in events:
        if e.get("ph") == "X":
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in threads.values():
        stack: list[dict] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            parent = stack[-1] if stack else None
            if parent is not None and e.get("cat") == "cpu_op" and not trace.is_comm(e) and (
                    trace.is_comm(parent) or trace.is_compute(parent)
                    or parent["name"] == f"{EVALUATE}{e['name']}"):
                drop.add(id(e))
            if not trace.ASYNC_SPAN.match(str(e.get("name", ""))):   # an isend's span: nobody's parent
                stack.append(e)
    return drop


def compact(data: dict, origin: float) -> dict:
    """A lab's trimmed trace cut to its last ProfilerStep window (events overlapping it),
    without args and nested ops, times from `origin` (module docstring)."""
    events = data["traceEvents"]
    windows = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")),
                     key=lambda e: e["ts"])
    lo, hi = windows[-1]["ts"], windows[-1]["ts"] + windows[-1]["dur"]
    keep = [e for e in events if e.get("ph") == "M" or (
        e.get("cat") != "Trace" and e["ts"] < hi and e["ts"] + e["dur"] > lo)]
    drop = _nested(keep)
    keep = [{**{k: v for k, v in e.items() if k != "args" or e.get("ph") == "M"},
             "ts": round(e["ts"] - origin, 3)} for e in keep if id(e) not in drop]
    info = dict(data["labkit"], steps=1, step_s=data["labkit"]["step_s"][-1:])
    return {**data, "labkit": info, "traceEvents": keep}


def main() -> int:
    import torch

    from labkit.labs.common.tracing import dumps
    from labkit.runtime.launch import run_lab

    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.json"):
        old.unlink()
    commands = []
    with tempfile.TemporaryDirectory() as tmp:
        for lab, n, args, variants in RUNS:
            run_lab(f"labkit.labs.{lab}", nproc=n, timeout=600, quiet=True,
                    args=[*args, "--trace", tmp])
            commands.append(f"labkit run {lab} -n {n} -- {' '.join(args)} --trace DIR")
            names = [f"{lab}-{v}-rank{r}.json" for v in variants for r in range(n)]
            traces = {name: json.loads(Path(tmp, name).read_text()) for name in names}
            origin = min(e["ts"] for t in traces.values() for e in t["traceEvents"]
                         if e.get("ph") == "X") // 1000 * 1000
            for name, data in traces.items():
                data = compact(data, origin)
                (OUT / name).write_text(dumps(data))
    total = sum(p.stat().st_size for p in OUT.glob("*.json"))
    print(f"{len(list(OUT.glob('*.json')))} traces, {total:,} bytes in {OUT}")
    print(f"recorded on {platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, python {platform.python_version()}")
    print("\n".join(commands))
    if total > LIMIT_BYTES:
        print(f"too large: {total:,} bytes > {LIMIT_BYTES:,}; record smaller runs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
