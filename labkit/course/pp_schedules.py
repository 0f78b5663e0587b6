"""Module 07's exercises 6 (1F1B written as a schedule) and 7 (ZB-H1 by hand), checked: a
learner's ``fn(stages, microbatches) -> {rank: [actions]}`` in torch's notation ("0F0", "3I1",
"3W1", "0B0"; labkit.pipeline_check).

    why = torch_problem(write_1f1b, 4, 8, "1f1b")     # "" when torch accepts it, else words
    why = order_problem(write_1f1b, 4, 8)             # also split_, memory_, bubble_problem
    runs = run_schedules(write_1f1b=write_1f1b, write_zbh1=write_zbh1)   # 4 ranks, one launch

A problem is one sentence naming the rank, step or action, the number found and the bound or
time it breaks, never a schedule that would pass. The learner's function runs first, its result
copied into plain strings (grading.plain), before anything it is compared with is computed.
Sources: 1F1B (Narayanan et al. 2021, §2.2), ZB-H1 (Qi et al. 2024, §3.1)."""
from __future__ import annotations

import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from labkit import pipeline
from labkit import pipeline_check as pc
from labkit.course import grading

_OP = re.compile(r"(\d+)([FIBW])(\d+)")
# the kinds each exercise writes, and why another is wrong
KINDS = {"1f1b": "FB", "zbh1": "FIW"}
WRONG_KIND = {
    "1f1b": "a split backward ({kind}: {what}); 1F1B here runs each backward whole, as one B "
            "(I and W are exercise 7's)",
    "zbh1": "a full backward (B); ZB-H1 splits every backward into I (input gradient) and W "
            "(weight gradient) so that the W can wait",
}
COSTS_1F1B = (1.0, 2.0)              # f, b: the simulator's defaults
# the lab run of both schedules (labkit run pp -n 4 -- --part custom): small, a few seconds
RUN_STAGES, RUN_MICROBATCHES = 4, 8
RUN_ARGS = ("--repeats", "2", "--sleep", "0.02")
PARITY = 1e-5                        # loss and gradients against one process (fp32)


def _shown(value, limit: int) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ..."


def _call(fn, p: int, m: int) -> str:
    return f"{getattr(fn, '__name__', 'function')}({p}, {m})"


def schedule_of(fn, stages: int, microbatches: int):
    """(actions {rank: [str]}, "") from the learner's `fn`, or (None, why not): it raised, it
    returned something that is not a schedule, or not one row per rank 0 .. stages - 1. A
    refusal of the grader's (a GradingError) propagates."""
    call = _call(fn, stages, microbatches)
    try:
        got = grading.plain(fn(stages, microbatches))
    except grading.GradingError:
        raise
    except NotImplementedError as exc:
        return None, f"{grading.NOT_ATTEMPTED}: {call} still raises NotImplementedError({exc})"
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        return None, f"{call} raised {type(exc).__name__}: {exc}"
    if not isinstance(got, (dict, list, tuple)):
        return None, (f"{call} returned {_shown(got, 80)} (a {type(got).__name__}); "
                      "expected a dict {rank: [action, ...]} with actions such as '0F0'")
    rows = got.items() if isinstance(got, dict) else enumerate(got)
    for rank, row in rows:
        items = row if isinstance(row, (list, tuple)) else [row]
        bad = next((a for a in items if not isinstance(a, str)), None)
        if bad is not None or not isinstance(row, (list, tuple, str)):
            what = bad if bad is not None else row
            return None, (f"{call}: rank {rank!r}'s actions hold {_shown(what, 60)} "
                          f"(a {type(what).__name__}); expected a list of strings such as "
                          "'0F0' (stage, kind, micro-batch), '' for idle")
    try:
        actions = pc.as_actions(got)
    except ValueError as exc:
        return None, f"{call}: {exc}"
    if sorted(actions) != list(range(stages)):
        have = ", ".join(map(str, actions)) or "none"
        return None, (f"{call} has rows for ranks {have}; p = {stages} ranks need one row each, "
                      "0 to p - 1 (rank r runs stage r)")
    return actions, ""


def _ops(actions):
    """(rank, step, text, stage, kind, micro-batch) of every action that parses."""
    for rank, row in actions.items():
        for step, text in enumerate(row):
            if hit := _OP.fullmatch(text):
                yield rank, step, text, int(hit[1]), hit[2], int(hit[3])


def layout_problem(actions, exercise: str) -> str:
    """Stage r on rank r only, and the exercise's kinds of action (`KINDS`)."""
    for rank, step, text, stage, kind, _ in _ops(actions):
        if stage != rank:
            return (f"rank {rank}, step {step}: {text} is stage {stage}'s; with one stage per "
                    "rank, rank r runs stage r's actions only")
        if kind not in KINDS[exercise]:
            return (f"rank {rank}, step {step}: {text} is "
                    + WRONG_KIND[exercise].format(kind=kind, what=pc.KINDS[kind]))
    return ""


def valid_schedule(fn, stages: int, microbatches: int, exercise: str):
    """(actions, "") when `fn`'s schedule has the exercise's layout and torch accepts it
    (labkit.pipeline_check.check_schedule: its parse, torch's _validate_schedule, the sends
    and receives it places and its dry run); else (None, why not)."""
    actions, why = schedule_of(fn, stages, microbatches)
    if why:
        return None, why
    why = layout_problem(actions, exercise)
    if why:
        return None, why
    check = pc.check_schedule(actions, stages, microbatches)
    if not check.ok:
        more = len(check.problems) - 1
        return None, ("torch's check: " + check.problems[0]
                      + (f" (and {more} more problem{'s' * (more > 1)})" if more > 0 else ""))
    return actions, ""


def torch_problem(fn, stages: int, microbatches: int, exercise: str) -> str:
    """"" when torch accepts `fn`'s schedule (and it has the exercise's layout), else why."""
    return valid_schedule(fn, stages, microbatches, exercise)[1]


def _valid_or_says(fn, p, m, exercise):
    actions, why = valid_schedule(fn, p, m, exercise)
    if why and not why.startswith(grading.NOT_ATTEMPTED):
        why = f"not a schedule torch runs, so it cannot be timed: {why}"
    return actions, why


def _units(x: float) -> str:
    return f"{x:g} unit{'s' * (x != 1)}"


def _waits_most(result) -> tuple[int, float]:
    """(rank, idle time in the step) of the rank that waits longest."""
    idle = [result.makespan - busy for busy in result.busy]
    rank = max(range(len(idle)), key=lambda r: (idle[r], -r))
    return rank, idle[rank]


def order_problem(fn, stages: int, microbatches: int) -> str:
    """1F1B's order on every rank, seen in what it costs: each rank holds min(p - r, m)
    micro-batches at its peak (labkit.pipeline_check.simulate_schedule's count: forwarded, not
    yet backward) and the simulated step at f = 1, b = 2 is labkit.pipeline.simulate("1f1b")'s."""
    p, m = stages, microbatches
    actions, why = _valid_or_says(fn, p, m, "1f1b")
    if why:
        return why
    f, b = COSTS_1F1B
    got = pc.simulate_schedule(actions, fwd=f, bwd=b)
    for rank, held in enumerate(got.peak_in_flight):
        bound = min(p - rank, m)
        if held > bound:
            return (f"rank {rank} holds {held:g} micro-batches at its peak (forwarded, not yet "
                    f"backward); 1F1B holds at most min(p - r, m) = {bound} there")
        if held < bound:
            return (f"rank {rank} holds at most {held:g} micro-batch{'es' * (held != 1)} at a "
                    f"time; 1F1B's warm-up fills the pipeline to min(p - r, m) = {bound} there "
                    "before the first backward comes back")
    want = pipeline.simulate("1f1b", p, m, fwd=f, bwd=b)
    if got.makespan > want.makespan * (1 + 1e-9):
        rank, idle = _waits_most(got)
        return (f"at f = {f:g}, b = {b:g} its simulated step takes {_units(got.makespan)}, "
                f"1F1B's {_units(want.makespan)}: rank {rank} waits {_units(idle)} of it, where "
                f"every rank of 1F1B waits (p - 1)(f + b) = {_units((p - 1) * (f + b))}: an "
                "action waits for a result that 1F1B's order would have ready")
    return ""


def split_problem(fn, stages: int, microbatches: int) -> str:
    """Every backward split: on rank r, stage r's I and W of every micro-batch, each once, no
    B (before torch's check, which says the same less directly)."""
    actions, why = schedule_of(fn, stages, microbatches)
    if why:
        return why
    why = layout_problem(actions, "zbh1")
    if why:
        return why
    for rank, row in actions.items():
        for kind in "FIW":
            mine = [j for _, _, _, _, k, j in _ops({rank: row}) if k == kind]
            twice = sorted({j for j in mine if mine.count(j) > 1})
            if twice:
                return (f"rank {rank} runs {rank}{kind}{twice[0]} more than once: each "
                        "micro-batch's " + pc.KINDS[kind] + " runs once")
            gone = [j for j in range(microbatches) if j not in mine]
            if gone:
                return (f"rank {rank} has no {kind} ({pc.KINDS[kind]}) of micro-batch"
                        f"{'es' * (len(gone) > 1)} {', '.join(map(str, gone))}: every "
                        "micro-batch goes forward, then through I and W, on every stage")
    return ""


def pending_weight_peak(row) -> int:
    """The most micro-batches a rank's row holds forwarded and not yet through their W (or B)."""
    held = peak = 0
    for _, _, _, _, kind, _ in _ops({0: row}):
        held += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
        peak = max(peak, held)
    return peak


def memory_problem(fn, stages: int, microbatches: int) -> str:
    """ZB-H1 keeps 1F1B's memory: on rank r at most min(p - r, m) micro-batches forwarded and
    not yet through I (simulate_schedule's count, the paper's), and at most min(p, m) not yet
    through W (a W still needs its micro-batch's saved inputs: 1F1B's peak, rank 0's)."""
    p, m = stages, microbatches
    actions, why = _valid_or_says(fn, p, m, "zbh1")
    if why:
        return why
    got = pc.simulate_schedule(actions, fwd=1.0, bwd=1.0, wgrad=1.0)
    for rank, held in enumerate(got.peak_in_flight):
        bound = min(p - rank, m)
        if held > bound:
            return (f"rank {rank} holds {held:g} micro-batches at its peak (forwarded, input "
                    f"gradient not yet run); ZB-H1 keeps 1F1B's bound, min(p - r, m) = {bound} "
                    "there")
    for rank, row in actions.items():
        held = pending_weight_peak(row)
        if held > min(p, m):
            return (f"rank {rank} holds {held} micro-batches whose W has not run yet at its "
                    "peak; a W needs its micro-batch's saved inputs, so ZB-H1 runs each W soon "
                    f"enough to hold no more than 1F1B's peak, min(p, m) = {min(p, m)} (rank 0's)")
    return ""


def zbh1_closed_form(stages: int, microbatches: int) -> tuple[float, float]:
    """(idle share of the step, makespan) of ZB-H1 at f = b = w = 1 (labkit.pipeline's
    bubble_formula("zero-bubble"): (p - 1)/(3m + p - 1) of a 3m + p - 1 step for m >= p)."""
    share = pipeline.bubble_formula("zero-bubble", stages, microbatches)[0]
    return share, 3 * microbatches / (1 - share)


def bubble_problem(fn, stages: int, microbatches: int) -> str:
    """The idle share of the simulated step at f = b = w = 1 (simulate_schedule) equals ZB-H1's
    closed form, below 1F1B's at the same work per micro-batch."""
    p, m = stages, microbatches
    actions, why = _valid_or_says(fn, p, m, "zbh1")
    if why:
        return why
    got = pc.simulate_schedule(actions, fwd=1.0, bwd=1.0, wgrad=1.0)
    share, makespan = zbh1_closed_form(p, m)
    if math.isclose(got.bubble_fraction, share, rel_tol=1e-9, abs_tol=1e-12):
        return ""
    one = pipeline.bubble_formula("1f1b", p, m)[0]
    rank, idle = _waits_most(got)
    worse = (" no better than 1F1B's" if got.bubble_fraction >= one * (1 - 1e-9) else "")
    return (f"at f = b = w = 1 its simulated step takes {_units(got.makespan)}, "
            f"{got.bubble_fraction:.1%} of it idle{worse}; ZB-H1's closed form (Qi et al. 2024, "
            f"§3.1) is {_units(makespan)}, {share:.1%} idle (1F1B: {one:.1%}): rank {rank} "
            f"waits {_units(idle)}, where every rank of ZB-H1 waits {_units(makespan - 3 * m)}: "
            "some rank waits where a W it holds could run, or runs a W while a forward or an "
            "input gradient that another rank waits for could")


# ---------------------------------------------------------------------------- on real ranks

@dataclass
class ScheduleRuns:
    """Both exercises' schedules run by torch's _PipelineScheduleRuntime on 4 gloo ranks in
    one launch (`labkit run pp -n 4 -- --part custom`): each one's lab row, or why it did not
    run."""

    rows: dict = field(default_factory=dict)        # name -> the lab's row (labkit.labs.pp)
    problems: dict = field(default_factory=dict)    # name -> why it did not run or failed
    output: list = field(default_factory=list)      # the ranks' lines

    def problem(self, name: str) -> str:
        """"" when `name`'s schedule ran with the loss and gradients of one process."""
        if name in self.problems:
            return self.problems[name]
        row = self.rows.get(name)
        if row is None:
            return f"{name}'s schedule did not run (the lab returned no row for it)"
        if not (row["loss_diff"] < PARITY and row["grad_max_diff"] < PARITY):
            return (f"{name}'s schedule ran, and its loss differs from one process's by "
                    f"{row['loss_diff']:.1e}, its gradients by {row['grad_max_diff']:.1e} "
                    f"(allowed {PARITY:g}): a micro-batch's backward did not meet its forward")
        return ""

    def summary(self) -> str:
        lines = []
        for name, why in self.problems.items():
            lines.append(f"{name}: not run: {why}")
        for name, row in self.rows.items():
            spread = [100 * (x["idle_measured"] - x["idle_simulated"]) for x in row["repeats"]]
            lines.append(
                f"{name}: loss {row['loss']:.6f} vs one process {row['reference_loss']:.6f} "
                f"(diff {row['loss_diff']:.1e}, gradients {row['grad_max_diff']:.1e}); idle "
                f"measured {row['idle_measured']:.1%}, simulated at the measured costs "
                f"{row['idle_simulated']:.1%} (measured - simulated over {len(spread)} steps: "
                f"{min(spread):+.1f} to {max(spread):+.1f} points); peak in flight "
                f"{[round(k, 2) for k in row['peak_in_flight']]}")
        return "\n".join(lines)


EXERCISE_OF = {"write_1f1b": "1f1b", "write_zbh1": "zbh1"}


def run_schedules(timeout: float = 240, **functions) -> ScheduleRuns:
    """Run each of `functions` (write_1f1b=..., write_zbh1=...: the keys name the files and the
    rows) at p = 4, m = 8 on 4 gloo ranks, in one launch; a schedule that is not valid
    (`valid_schedule`), or a function that is None (not defined), is not run and says why.
    Launches nothing when none is valid."""
    from labkit.runtime.launch import LabError, run_lab

    runs = ScheduleRuns()
    p, m = RUN_STAGES, RUN_MICROBATCHES
    folder = Path(tempfile.mkdtemp(prefix="labkit-schedules-"))
    args = ["--part", "custom"]
    for name, fn in functions.items():
        if fn is None:
            runs.problems[name] = f"{name} is not defined: run its exercise's cell first"
            continue
        actions, why = valid_schedule(fn, p, m, EXERCISE_OF[name])
        if why:
            runs.problems[name] = why
            continue
        args += ["--schedule", str(pc.write_schedule(actions, folder / f"{name}.csv"))]
    if len(args) == 2:
        return runs
    try:
        lab = run_lab("labkit.labs.pp", nproc=p, args=[*args, *RUN_ARGS], timeout=timeout,
                      quiet=True)
    except LabError as exc:
        for name in functions:
            runs.problems.setdefault(name, f"the run on {p} ranks failed: {exc}")
        return runs
    runs.output = list(lab.output)
    rows = lab.results[0]["schedules"]
    for name in functions:
        if name not in runs.problems and name in rows:
            runs.rows[name] = rows[name]
    return runs
