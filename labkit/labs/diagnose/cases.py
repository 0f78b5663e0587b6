"""The builders of labkit.labs.diagnose's cases: each runs its lab(s) with the fault injected,
turns what they report into evidence, and writes the question, the options (the correct one
first; `build` shuffles them) and why each is right or wrong, quoting the measurement.

Each case has two functions: NAME_plan(rng) draws the fault's parameters and writes the title,
the question and the options from them alone (never from a measured number), so one seed always
gives the same question; NAME(plan, seed, timeout, env) runs the lab(s) (seed: the labs' --seed;
env: run_lab's) and returns why, evidence and numbers. Predictions come from the cost models: labkit.scaling (straggler, buckets, ddp_step_time, sampler_num_samples),
labkit.pipeline (bubble_formula), labkit.memory (estimate_memory, activation_bytes_per_layer).
"""
from __future__ import annotations

import glob
import os
import re
import statistics
import tempfile

from labkit.runtime.launch import LabError, run_lab

MS = 1e3


def launch(target: str, nproc: int, args, timeout: float, env=None, fails: bool = False):
    """(result, error): run_lab's LabResult, and, for a lab meant to fail (`fails`), the
    LabError it raised (its result then; a lab not meant to fail raises it, and one meant to
    fail that finished is a RuntimeError). A failure message too long to read is kept by
    run_lab in a file named after the run (labkit.runtime.rundir.cap_message): read back here
    as the message, and the file removed (it belongs to this run)."""
    try:
        result = run_lab(target, nproc=nproc, args=[str(a) for a in args], timeout=timeout,
                         env=env, quiet=True)
    except LabError as exc:
        if exc.result is None or not fails:
            raise
        pattern = os.path.join(tempfile.gettempdir(), f"labkit-error-{exc.result.run_id}-*.txt")
        for path in glob.glob(pattern):         # labkit.runtime.rundir.cap_message's file
            with open(path, encoding="utf-8", errors="replace") as f:
                exc.args = (f.read().rstrip("\n"),)
            os.remove(path)
        return exc.result, exc
    if fails:
        raise RuntimeError(f"{target} {' '.join(map(str, args))} finished; it was meant to fail")
    return result, None


def log_text(result, error=None) -> str:
    """The ranks' output without their tracebacks, then the launcher's failure message."""
    lines, in_tb = [], set()
    for line in result.output:
        m = re.match(r"^\[rank (\d+)\] ?(.*)$", line)
        rank, text = (m.group(1), m.group(2)) if m else (None, line)
        if text.startswith("Traceback (most recent call last)"):
            in_tb.add(rank)
        if rank not in in_tb:
            lines.append(line)
    if error is not None:
        lines += ["", "run_lab raised LabError:", error.args[0]]
    return "\n".join(lines)


def answered(why: list[str], evidence: dict, numbers: dict) -> dict:
    """A case's result: `why[0]` explains the right option (first in the plan), the rest why
    each other option is wrong; the evidence and the numbers the explanations quote."""
    return dict(why=[f"{'Yes' if i == 0 else 'No'}: {w}" for i, w in enumerate(why)],
                evidence=evidence, numbers=numbers)


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


# ---------------------------------------------------------------------------------------------
# 1. straggler

def straggler_plan(rng) -> dict:
    world, slow = 2, rng.choice([0, 1])
    return dict(
        params=dict(world=world, slow=slow, sleep=rng.choice([0.08, 0.1, 0.12])),
        title="Every rank got slower",
        question=(f"A {world}-rank torch DDP run (GPT-2, gloo) was running at a steady step time; "
                  "from one step on, every rank's step time went up together. The evidence has "
                  "each rank's step broken into forward, other work before the backward, "
                  "backward (which under DDP includes waiting for the gradient all-reduce) and "
                  "optimizer. Why are ALL ranks slow?"),
        options=[f"Rank {slow} is a straggler: it does extra work each step, and the other "
                 f"rank waits for its gradients in the all-reduce, so every step takes as long "
                 f"as rank {slow}'s",
                 "The network got slower: the gradient all-reduce itself takes longer on every "
                 "rank",
                 "Every rank's compute got slower (a shared or throttled machine)",
                 "The gradient buckets are too small: too many all-reduces per step"])


def straggler(plan: dict, seed: int, timeout: float, env=None) -> dict:
    from labkit.scaling import straggler as predict, throughput_loss

    world, slow, sleep = (plan["params"][k] for k in ("world", "slow", "sleep"))
    other = 1 - slow
    result, _ = launch("labkit.labs.diagnose.ddp", world,
                       ["--part", "straggler", "--slow-rank", slow, "--sleep", sleep,
                        "--steps", 4, "--seed", seed], timeout, env)
    r = result.results[0]
    timings = r["timings"]

    def phase(rank, name, a, b):      # median seconds from mark a to mark b in phase `name`
        return med([s[b] - s[a] for s in timings[rank] if s["phase"] == name])

    step = {(k, p): phase(k, p, "start", "end") for k in range(world)
            for p in ("healthy", "straggler")}
    fwd = {(k, p): phase(k, p, "start", "forward") for k in range(world)
           for p in ("healthy", "straggler")}
    extra = phase(slow, "straggler", "forward", "extra")
    bwd = {(k, p): phase(k, p, "extra", "backward") for k in range(world)
           for p in ("healthy", "straggler")}
    work = [step[k, "healthy"] + (extra if k == slow else 0.0) for k in range(world)]
    pred = predict(work, baseline=med([step[k, "healthy"] for k in range(world)]))
    measured = med([step[k, "straggler"] for k in range(world)])
    increase = measured / pred.baseline - 1
    calls = {p: r["allreduce"][p] for p in ("healthy", "straggler")}
    numbers = dict(
        world_size=world, slow_rank=slow, sleep=sleep, extra_s=extra,
        healthy_step_s=[step[k, "healthy"] for k in range(world)],
        straggler_step_s=[step[k, "straggler"] for k in range(world)],
        forward_s={p: [fwd[k, p] for k in range(world)] for p in ("healthy", "straggler")},
        backward_s={p: [bwd[k, p] for k in range(world)] for p in ("healthy", "straggler")},
        other_backward_increase_s=bwd[other, "straggler"] - bwd[other, "healthy"],
        predicted_step_s=pred.step_time, ratio=measured / pred.step_time,
        step_time_increase=increase, throughput_loss=throughput_loss(max(0.0, increase)),
        predicted_throughput_loss=pred.throughput_loss,
        allreduce_calls={p: c["calls"] for p, c in calls.items()},
        allreduce_bytes={p: c["bytes"] for p, c in calls.items()})
    timeline = []
    for k in range(world):
        for s in timings[k]:
            for kind, a, b in (("forward", "start", "forward"), ("extra work", "forward", "extra"),
                               ("backward", "extra", "backward"), ("optimizer", "backward", "end")):
                if kind == "extra work" and not (k == slow and s["phase"] == "straggler"):
                    continue           # no extra work here: a gap of microseconds
                if s[b] > s[a]:
                    timeline.append(dict(rank=k, kind=kind, start=s[a], end=s[b], step=s["step"]))
    n_healthy = sum(s["phase"] == "healthy" for s in timings[0])
    evidence = dict(
        log=log_text(result),
        step_times={f"rank {k}": [s["end"] - s["start"] for s in timings[k]]
                    for k in range(world)},
        fault_from=n_healthy, timeline=timeline,
        timeline_title="each rank's steps (backward includes waiting for the all-reduce)",
        allreduce_per_step=calls)
    ms = {k: MS * v for k, v in (("extra", extra), ("pred", pred.step_time),
                                 ("meas", measured))}
    why = [
        f"the slow rank {slow} did {ms['extra']:.0f} ms of extra work per step; rank {other}'s "
        f"backward, which includes waiting for the gradient all-reduce, grew by "
        f"{MS * numbers['other_backward_increase_s']:.0f} ms: it waited for rank {slow}. "
        f"labkit.scaling.straggler (every rank takes the slowest rank's time) predicts "
        f"{ms['pred']:.0f} ms per step, measured {ms['meas']:.0f} ms (ratio "
        f"{numbers['ratio']:.2f}); throughput lost {pct(numbers['throughput_loss'])} "
        f"(predicted {pct(pred.throughput_loss)}).",
        f"the all-reduce moved the same {calls['straggler']['bytes']:,} B in "
        f"{calls['straggler']['calls']} call(s) per step before and after, and rank {slow}'s "
        f"own backward (all-reduce included) took {MS * bwd[slow, 'healthy']:.0f} ms before and "
        f"{MS * bwd[slow, 'straggler']:.0f} ms after: the extra time on rank {other} is "
        f"waiting for rank {slow}, not sending.",
        f"rank {other}'s forward took {MS * fwd[other, 'healthy']:.1f} ms before and "
        f"{MS * fwd[other, 'straggler']:.1f} ms after; only rank {slow} does more work "
        f"({ms['extra']:.0f} ms per step): the others are slow because they wait for it.",
        f"the all-reduces per step did not change: {calls['healthy']['calls']} before, "
        f"{calls['straggler']['calls']} after; too-small buckets would show many calls and "
        "would slow every step from the start.",
    ]
    return answered(why, evidence, numbers)


# ---------------------------------------------------------------------------------------------
# 2. small buckets

def small_buckets_plan(rng) -> dict:
    world, cap = 2, rng.choice([0.001, 0.002, 0.005])
    return dict(
        params=dict(world=world, cap=cap),
        title="A smaller bucket made DDP slower",
        question=(f"The same {world}-rank torch DDP run (GPT-2, gloo), once with "
                  f"bucket_cap_mb={cap:g} (set to \"start communication earlier\") and once "
                  "with the default 25 MiB, beside the same step with no communication at all. "
                  f"Why is the bucket_cap_mb={cap:g} run slower?"),
        options=["Too many small all-reduces: each one pays a fixed per-call latency, and the "
                 "calls add up to more than the backward can hide",
                 "Smaller buckets send more bytes in all",
                 "Smaller buckets start their all-reduces later, so less of the communication "
                 "overlaps the backward",
                 "DDP's forward and backward compute got slower with small buckets"])


def small_buckets(plan: dict, seed: int, timeout: float, env=None) -> dict:
    from labkit.scaling import MiB, buckets, ddp_step_time
    from labkit.plots.timeline import summarize

    world, cap = plan["params"]["world"], plan["params"]["cap"]
    result, _ = launch("labkit.labs.diagnose.ddp", world,
                       ["--part", "buckets", "--bucket-mb", cap, "--layers", 4, "--steps", 12,
                        "--seed", seed],
                       timeout, env)
    r = result.results[0]
    G, link = r["gradient_bytes"], r["link"]
    labels = {"small": f"bucket_cap_mb={cap:g}", "default": "bucket_cap_mb=25 (default)",
              "local": "no DDP (compute only)"}
    calls = {k: r["allreduce"][k]["calls"] for k in ("small", "default")}
    sent = {k: r["allreduce"][k]["bytes"] for k in ("small", "default")}
    step = r["step_s"]
    compute = step["local"]
    pred = {k: ddp_step_time(r["num_params"], world, None, compute_seconds=compute,
                             grad_bytes=4, bucket_size_mb=G / calls[k] / MiB, overlap=1.0,
                             bandwidth=link["bandwidth"], latency=link["latency"])
            for k in calls}
    first = {k: min((a[0] for a in r["timeline"][k]["allreduce"]), default=float("nan"))
             for k in calls}
    summary = {k: summarize(r["timeline"][k]) for k in calls}
    end = {k: summary[k]["compute_end"] for k in calls}
    numbers = dict(
        world_size=world, bucket_mb=cap, gradient_bytes=G, param_tensors=r["param_tensors"],
        allreduce_calls=calls, allreduce_bytes=sent, torch_buckets=r["torch_buckets"],
        formula_buckets=buckets(G, cap)[0], step_s=dict(step),
        exposed_s={k: step[k] - compute for k in calls},
        latency=link["latency"], bandwidth=link["bandwidth"],
        latency_cost_s={k: pred[k].latency_time for k in calls},
        predicted_step_s={k: pred[k].total for k in calls},
        ratio={k: step[k] / pred[k].total for k in calls},
        per_call_s=(step["small"] - step["default"]) / (calls["small"] - calls["default"]),
        first_allreduce_s=first, backward_end_s=end)
    timeline = []
    for k in ("small", "default"):
        ev = r["timeline"][k]
        lane = labels[k]
        timeline.append(dict(rank=0, lane=f"{lane}: compute", kind="forward", start=0.0,
                             end=ev["forward_end"]))
        timeline.append(dict(rank=0, lane=f"{lane}: compute", kind="backward",
                             start=ev["forward_end"], end=summary[k]["compute_end"]))
        timeline += [dict(rank=0, lane=f"{lane}: all-reduce", kind="all_reduce", start=a,
                          end=b, bytes=n) for a, b, n in ev["allreduce"]]
    evidence = dict(log=log_text(result),
                    step_times={labels[k]: r["step_times"][k] for k in labels},
                    timeline=timeline,
                    timeline_title="one step on rank 0 (instrumented, so slower than the timed "
                                   "ones)",
                    allreduce_per_step={labels[k]: r["allreduce"][k] for k in labels})
    slower = step["small"] / step["default"]
    why = [
        f"{calls['small']} all-reduces per step instead of {calls['default']}, each paying a "
        f"fixed cost: the step took {MS * step['small']:.1f} ms against "
        f"{MS * step['default']:.1f} ms ({slower:.1f}x; {MS * compute:.1f} ms without any "
        f"communication), {MS * numbers['per_call_s']:.2f} ms per extra call. "
        f"labkit.scaling.ddp_step_time puts the latency at 2(N-1) alpha per call, "
        f"{MS * pred['small'].latency_time:.1f} ms per step against "
        f"{MS * pred['default'].latency_time:.1f} ms, and predicts {MS * pred['small'].total:.1f}"
        f" ms per step (ratio {numbers['ratio']['small']:.2f}) at alpha = "
        f"{MS * link['latency']:.2f} ms, " + (
            "fitted to this run's all-reduces (a few, timed on busy cores: a rough figure)"
            if link["name"] == "measured" else
            f"labkit.hardware's {link['name']!r} (the fit to this run failed)") + ".",
        f"both sent {sent['small']:,} B of gradients per step ({sent['default']:,} B with the "
        "default): the bytes are the gradients' size whatever the bucket size.",
        f"small buckets start sooner, not later: in the instrumented step the first "
        f"all-reduce was issued {MS * (end['small'] - first['small']):.1f} ms before the "
        f"backward ended with {cap:g} MiB buckets, and "
        f"{MS * (first['default'] - end['default']):.2f} ms after it with 25 MiB (one bucket, "
        "ready only when the last gradient is). Starting early is what small buckets are for; "
        "their cost is the number of calls.",
        f"the compute is the same in both (same model, same batch): {MS * compute:.1f} ms per "
        "step without any communication; the difference between the runs is communication.",
    ]
    return answered(why, evidence, numbers)


# ---------------------------------------------------------------------------------------------
# 3. few micro-batches

def few_microbatches_plan(rng) -> dict:
    p, few = 4, rng.choice([4, 5])
    many = 3 * few
    return dict(
        params=dict(p=p, few=few, many=many),
        title="A pipeline that mostly waits",
        question=(f"A {p}-stage pipeline (1F1B by hand, one stage per rank, the same layers on "
                  f"each) runs m={few} micro-batches per step; the timeline shows every stage "
                  f"idle for a large share of the step (a run with m={many} is beside it). "
                  "What is the main cause, and what fixes it?"),
        options=["The pipeline bubble: too few micro-batches for the stages; raise the number "
                 "of micro-batches (or interleave stages)",
                 "Slow point-to-point links: the activations take long to reach the next stage",
                 "Unbalanced stages: one stage is slower and the others wait for it",
                 "1F1B's bubble is larger than GPipe's: switch the schedule to GPipe"])


def few_microbatches(plan: dict, seed: int, timeout: float, env=None) -> dict:
    from labkit.pipeline import bubble_formula, min_microbatches

    p, few, many = (plan["params"][k] for k in ("p", "few", "many"))
    sizes = ["--layers", 4, "--hidden", 32, "--heads", 2, "--seq", 16, "--sleep", 0.01,
             "--repeats", 2, "--seed", seed]
    runs, logs = {}, []
    for m in (few, many):
        result, _ = launch("labkit.labs.pp", p, ["--part", "byhand", "--microbatches", m,
                                                 *sizes], timeout, env)
        runs[m] = result.results[0]["schedules"]
        logs.append(log_text(result))
    row, rows_many = runs[few]["1f1b"], runs[many]["1f1b"]
    f_stage = [med([e["end"] - e["start"] for e in row["events"]
                    if e["kind"] == "F" and e["stage"] == s]) for s in range(p)]
    target = 0.1
    numbers = dict(
        stages=p, microbatches=few, more_microbatches=many,
        idle_measured={few: row["idle_measured"], many: rows_many["idle_measured"]},
        idle_simulated={few: row["idle_simulated"], many: rows_many["idle_simulated"]},
        idle_formula={m: bubble_formula("1f1b", p, m)[0] for m in (few, many)},
        gpipe_idle_measured=runs[few]["gpipe"]["idle_measured"],
        peak_in_flight={"1f1b": row["peak_in_flight"],
                        "gpipe": runs[few]["gpipe"]["peak_in_flight"]},
        fwd_s=row["fwd_s"], bwd_s=row["bwd_s"], p2p_s=row["p2p_s"],
        stage_forward_s=f_stage, stage_imbalance=max(f_stage) / min(f_stage) - 1,
        step_s={few: row["step_measured"], many: rows_many["step_measured"]},
        min_microbatches_for_10pct=min_microbatches(p, target))
    label = {m: f"1F1B, p={p}, m={m} (measured)" for m in (few, many)}
    evidence = dict(log="\n\n".join(logs),
                    pipeline={label[few]: row["events"], label[many]: rows_many["events"]},
                    idle_share={label[m]: numbers["idle_measured"][m] for m in (few, many)})
    idle, formula = numbers["idle_measured"], numbers["idle_formula"]
    why = [
        f"with m={few} on p={p} stages the fill and drain take (p-1)/(m+p-1) = "
        f"{pct(formula[few])} of the step (labkit.pipeline.bubble_formula); measured "
        f"{pct(idle[few])} (labkit.pipeline.simulate at this run's op times, which counts each "
        f"op's overhead too: {pct(numbers['idle_simulated'][few])}). With m={many} the formula "
        f"gives {pct(formula[many])}, measured {pct(idle[many])}; "
        f"{numbers['min_microbatches_for_10pct']} micro-batches bring the formula under 10%. "
        "Raise m (smaller micro-batches, the same global batch) or interleave.",
        f"a message between stages added {MS * row['p2p_s']:.3f} ms on average (the wait for "
        f"an input beyond the {MS * row['overhead_s']:.2f} ms each op spends posting its "
        f"sends and receives), against {MS * row['fwd_s']:.1f} ms of forward and "
        f"{MS * row['bwd_s']:.1f} ms of backward per micro-batch on a stage: the idle time is "
        "the schedule's, not the link's.",
        f"the idle share fell from {pct(idle[few])} to {pct(idle[many])} when m went from "
        f"{few} to {many}: a slow stage would keep the others waiting on every micro-batch, "
        "whatever m. Each stage has the same layers; their median forward took "
        f"{', '.join(f'{MS * t:.1f}' for t in f_stage)} ms.",
        f"GPipe in the same run idled {pct(numbers['gpipe_idle_measured'])}, 1F1B "
        f"{pct(idle[few])}: both have the bubble (p-1)/(m+p-1). 1F1B changes the memory, not "
        f"the bubble: at most {max(row['peak_in_flight'])} micro-batches in flight on a stage "
        f"against GPipe's {max(runs[few]['gpipe']['peak_in_flight'])}.",
    ]
    return answered(why, evidence, numbers)
