"""The labs' --trace DIR (labkit.labs.common.tracing): each traced lab runs once on 2 gloo ranks
(module fixtures, smallest models), and its Chrome traces are checked against what the lab
measured itself (the file's "labkit" key) and against what it planned: one file per rank per
variant, the profiled steps, each step's collectives on the main thread (c10d::* events) equal
to measure.CollectiveCounter's count and to the lab's plan, the trace's step span near the
step's wall time. Timing asserts are structural or generous (2 busy cores): a straggler's sleep
is idle time on its own rank; torch DDP's single bucket is all-reduced only after the backward.
"""
from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

import pytest

from labkit import trace
from labkit.runtime.launch import run_lab

N, LAYERS, SLEEP = 2, 2, 0.05
SMALL = ["--layers", str(LAYERS), "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2"]
C10D = {"all_reduce": "c10d::allreduce_", "all_gather": "c10d::_allgather_base_",
        "reduce_scatter": "c10d::_reduce_scatter_base_", "send": "c10d::send",
        "recv": "c10d::recv_", "barrier": "c10d::barrier", "broadcast": "c10d::broadcast_"}
EVALUATE = "autograd::engine::evaluate_function: "
DDP = ("naive", "overlapped", "bucketed", "torch", "torch-onebucket")
RUNS = {  # lab: (arguments, variants)
    "ddp": ([*SMALL, "--part", "compare", "--steps", "5", "--bucket-mb", "0.1"], DDP),
    "straggler": ([*SMALL, "--part", "straggler", "--steps", "1", "--sleep", str(SLEEP)],
                  ("straggler",)),
    "fsdp": (["--part", "timeline", "--steps", "3", "--prefetch", "1"], ("prefetch0", "prefetch1")),
    "pp": (["--part", "byhand", "--layers", "2", "--microbatches", "2", "--sleep", "0.002",
            "--repeats", "1"], ("gpipe", "1f1b")),
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    """{(lab, variant): [rank 0's file, rank 1's]}, every lab run once with --trace."""
    out = {}
    for lab, (args, variants) in RUNS.items():
        folder = tmp_path_factory.mktemp(lab)
        module = "labkit.labs.ddp" if lab == "straggler" else f"labkit.labs.{lab}"
        run_lab(module, nproc=N, timeout=240, quiet=True, args=[*args, "--trace", str(folder)])
        name = "ddp" if lab == "straggler" else lab
        assert sorted(p.name for p in folder.glob("*.json")) == sorted(
            f"{name}-{v}-rank{r}.json" for v in variants for r in range(N))
        for v in variants:
            out[lab, v] = [folder / f"{name}-{v}-rank{r}.json" for r in range(N)]
    return out


def info(path) -> dict:
    return json.loads(Path(path).read_text())["labkit"]


def windows(path) -> list[dict]:
    """The ProfilerStep events of a trace (on the main thread), in order."""
    return sorted((e for e in trace.load(path) if str(e["name"]).startswith("ProfilerStep#")),
                  key=lambda e: e["ts"])


def main_thread(path, window) -> list[dict]:
    lo, hi = window["ts"], window["ts"] + window["dur"]
    return [e for e in trace.load(path) if e.get("tid") == window["tid"] and lo <= e["ts"] < hi]


@pytest.mark.multirank
def test_each_file_holds_the_steps_it_says(traces):
    for (lab, variant), files in traces.items():
        for rank, path in enumerate(files):
            meta = info(path)
            assert (meta["variant"], meta["rank"], meta["world"], meta["backend"]) == \
                (variant, rank, N, "gloo")
            assert meta["steps"] == 2 == len(meta["step_s"])
            assert len(trace.steps(path)) == meta["steps"], (path, trace.steps(path))
            assert trace.summarize(path).rank == rank      # distributedInfo kept


@pytest.mark.multirank
def test_collectives_on_the_main_thread_match_the_counter_and_the_plan(traces):
    """Each step's c10d::* events on the thread of ProfilerStep: the counter's kinds, each as
    often as counted (in another step: the warm-up's), and all-reduces as the DDP planned:
    one per parameter tensor (naive, overlapped: GPT-2 has 12 per block + 4), one per bucket."""
    for (lab, variant), files in traces.items():
        for path in files:
            meta = info(path)
            want = {C10D[k]: n for k, n in meta["collectives_per_step"].items()}
            assert want, (path, "no collective counted")
            for w in windows(path):
                got = collections.Counter(e["name"] for e in main_thread(path, w)
                                          if str(e["name"]).startswith("c10d::"))
                assert got == want, (path, w["name"], got, want)
            if lab in ("ddp", "straggler"):
                plan = 12 * LAYERS + 4 if variant in ("naive", "overlapped") else \
                    meta["planned_all_reduce"]
                assert meta["collectives_per_step"]["all_reduce"] == plan, (path, meta)
    assert info(traces["ddp", "torch-onebucket"][0])["collectives_per_step"] == {"all_reduce": 1}
    for v in ("bucketed", "torch"):      # 0.1 MiB buckets: several
        assert info(traces["ddp", v][0])["collectives_per_step"]["all_reduce"] > 1


@pytest.mark.multirank
def test_step_span_is_near_the_measured_step(traces):
    """The ProfilerStep window holds the timed step plus the profiler's own step bookkeeping;
    a busy machine stretches either, hence the factor 2 either way."""
    for files in traces.values():
        for path in files:
            for n, measured in zip(trace.steps(path), info(path)["step_s"]):
                ratio = trace.summarize(path, step=n).span_s / measured
                assert 0.5 <= ratio <= 2, (path, n, ratio)


@pytest.mark.multirank
def test_straggler_sleep_is_idle_on_its_rank_and_waited_for_by_the_other(traces):
    """The sleeping rank computes nothing during the sleep (time without compute >= the sleep,
    whatever the load; not idle >= the sleep: the previous step's all-reduce, finished late on a
    loaded machine, can overlap the sleep: measured 46 ms idle in a 50 ms sleep); the other
    waits for it in the all-reduce: over both steps its communication holds at least half of
    the two sleeps (load on the waiting rank could only eat into the wait)."""
    files = traces["straggler", "straggler"]
    slow = info(files[0])["slow_rank"]
    sleep = info(files[0])["sleep"]
    assert sleep == pytest.approx(SLEEP)
    for n in trace.steps(files[slow]):
        summary = trace.summarize(files[slow], step=n)
        assert summary.span_s - summary.compute_s >= sleep, (n, summary)
    waiting = files[1 - slow]
    comm = sum(trace.summarize(waiting, step=n).comm_s for n in trace.steps(waiting))
    assert comm >= 0.5 * sleep * len(trace.steps(waiting)), comm


@pytest.mark.multirank
def test_one_bucket_is_all_reduced_only_after_the_backward(traces):
    """torch DDP's one bucket is ready when the last gradient is: its all-reduce starts after
    every backward node (but the gradients' AccumulateGrad) has ended, so nothing overlaps;
    with 0.1 MiB buckets the first all-reduce starts while backward nodes are still to run."""
    for variant, after in (("torch-onebucket", True), ("torch", False)):
        for path in traces["ddp", variant]:
            for w in windows(path):
                events = main_thread(path, w)
                backward = max(e["ts"] + e["dur"] for e in events if e["name"].startswith(
                    EVALUATE) and "AccumulateGrad" not in e["name"])
                first = min(e["ts"] for e in events if e["name"] == "c10d::allreduce_")
                assert (first >= backward) is after, (path, w["name"], first - backward)


def test_compacted_course_traces_keep_the_totals(traces):
    """tools/record_course_traces.py's compact (what is shipped) keeps every total of the step."""
    spec = importlib.util.spec_from_file_location(
        "record_course_traces", Path(__file__).parents[2] / "tools" / "record_course_traces.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for key in (("ddp", "torch"), ("fsdp", "prefetch1"), ("pp", "1f1b")):
        path = traces[key][1]
        data = json.loads(path.read_text())
        small = tool.compact(data, 0.0)
        assert len(small["traceEvents"]) < len(data["traceEvents"])
        step = trace.steps(path)[-1]
        assert trace.steps(small) == [step]
        a, b = trace.summarize(data, step=step), trace.summarize(small, step=step)
        for f in ("span_s", "compute_s", "comm_s", "exposed_comm_s", "idle_s"):
            assert getattr(b, f) == pytest.approx(getattr(a, f), abs=1e-8), (key, f)


@pytest.mark.parametrize("lab,args", [("ddp", ["--part", "flags"]), ("fsdp", ["--part", "compare"]),
                                      ("pp", ["--part", "torch"]), ("ddp", [])])
def test_trace_is_refused_where_it_cannot_be_written_or_is_not_taken(lab, args, capsys, tmp_path):
    from importlib import import_module

    parse = import_module(f"labkit.labs.{lab}.lab").parse_args
    where = str(tmp_path / "file") if args else "/proc/labkit-no"
    Path(tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        parse([*args, "--trace", where])
    err = capsys.readouterr().err
    assert "argument --trace" in err and ("writes no trace" in err if args else "/proc" in err)
