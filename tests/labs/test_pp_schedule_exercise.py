"""Module 07's exercises 6 and 7 (1F1B written as a schedule, ZB-H1 by hand): the checks of
labkit.course.pp_schedules pass right answers (the solutions' and torch's own schedules) and
fail the usual wrong ones with a sentence that names the mistake (rank, step, action, the
number and the bound), never the schedule that would pass. All of it without ranks but one
launch, which runs both right answers (tests/course/test_grading.py grades the notebook)."""
from __future__ import annotations

import re

import pytest

from labkit.course import grading, pp_schedules as ps
from labkit.pipeline_check import read_schedule

SHAPES = [(4, 8), (4, 3), (2, 1), (3, 5), (8, 16), (4, 4)]


# ----------------------------------------------------------------------- learners' answers

def one_f_one_b(p, m, kind="B"):
    """1F1B; kind "IW": each backward split, its W right after its I."""
    out = {}
    for r in range(p):
        warm = min(p - r - 1, m)
        back = (lambda j: [f"{r}I{j}", f"{r}W{j}"]) if kind == "IW" else (lambda j: [f"{r}B{j}"])
        row = [f"{r}F{j}" for j in range(warm)]
        for j in range(m - warm):
            row += [f"{r}F{warm + j}", *back(j)]
        out[r] = row + [a for j in range(m - warm, m) for a in back(j)]
    return out


def zbh1(p, m, wait=None, warm_extra=0):
    """ZB-H1: 1F1B's F and I, rank r's W waiting wait(r) micro-batches (r: the paper's)."""
    out = {}
    for r in range(p):
        delay = r if wait is None else wait(r)
        warm = min(p - r - 1 + warm_extra, m)
        row = [f"{r}F{j}" for j in range(warm)]
        for j in range(m):
            row += [f"{r}F{warm + j}"] if warm + j < m else []
            row.append(f"{r}I{j}")
            if j >= delay:
                row.append(f"{r}W{j - delay}")
        out[r] = row + [f"{r}W{j}" for j in range(max(0, m - delay), m)]
    return out


def write_1f1b(stages, microbatches):
    return one_f_one_b(stages, microbatches)


def write_zbh1(stages, microbatches):
    return zbh1(stages, microbatches)


def stub(stages, microbatches):
    raise NotImplementedError("Exercise write_1f1b: write ~9 lines")


def gpipe(stages, microbatches):
    return {r: [f"{r}F{j}" for j in range(microbatches)] + [f"{r}B{j}" for j in range(microbatches)]
            for r in range(stages)}


def swapped(out, rank, a, b):
    """`out` with actions a and b of `rank` swapped."""
    row = out[rank]
    i, j = row.index(a), row.index(b)
    row[i], row[j] = row[j], row[i]
    return out


def backward_first(stages, microbatches):
    """1F1B with rank 1's first backward moved before its first forward."""
    return swapped(one_f_one_b(stages, microbatches), 1, "1F0", "1B0")


def warm_up_reversed(stages, microbatches):
    """Rank r warms up with r forwards instead of p - r - 1: ranks 0 and 1 wait for each other."""
    out = {}
    for r in range(stages):
        warm = min(r, microbatches)
        row = [f"{r}F{j}" for j in range(warm)]
        for j in range(microbatches - warm):
            row += [f"{r}F{warm + j}", f"{r}B{j}"]
        out[r] = row + [f"{r}B{j}" for j in range(microbatches - warm, microbatches)]
    return out


def one_at_a_time(stages, microbatches):
    return {r: [a for j in range(microbatches) for a in (f"{r}F{j}", f"{r}B{j}")]
            for r in range(stages)}


def cool_down_reversed(stages, microbatches):
    """1F1B whose cool-down runs its backwards last micro-batch first: 1F1B's memory, a longer
    step."""
    out = one_f_one_b(stages, microbatches)
    for r, row in out.items():
        k = stages - r - 1
        if k > 1:
            row[-k:] = row[-k:][::-1]
    return out


def split_1f1b(stages, microbatches):
    return one_f_one_b(stages, microbatches, "IW")


def shifted_stages(stages, microbatches):
    """Every rank runs the next rank's stage."""
    return {r: [a.replace(f"{r}", f"{(r + 1) % stages}", 1) for a in row]
            for r, row in one_f_one_b(stages, microbatches).items()}


def only_rank_0(stages, microbatches):
    return {0: one_f_one_b(stages, microbatches)[0]}


def a_string(stages, microbatches):
    return "0F0"


def missing_w(stages, microbatches):
    out = zbh1(stages, microbatches)
    out[2].remove(f"2W{microbatches - 1}")
    return out


def all_ws_last(stages, microbatches):
    return zbh1(stages, microbatches, wait=lambda r: microbatches)


def ws_at_once(stages, microbatches):
    return zbh1(stages, microbatches, wait=lambda r: 0)


def one_more_warm_up(stages, microbatches):
    return zbh1(stages, microbatches, warm_extra=1)


def w_before_i(stages, microbatches):
    return swapped(zbh1(stages, microbatches), 0, "0I0", "0W0")


# --------------------------------------------------------------------- right answers pass

@pytest.mark.parametrize("p, m", SHAPES)
def test_the_solutions_pass_every_check(p, m):
    assert ps.torch_problem(write_1f1b, p, m, "1f1b") == ""
    assert ps.order_problem(write_1f1b, p, m) == ""
    for check in (ps.split_problem, ps.memory_problem, ps.bubble_problem):
        assert check(write_zbh1, p, m) == "", check.__name__
    assert ps.torch_problem(write_zbh1, p, m, "zbh1") == ""


def test_torchs_own_schedules_pass_and_zbh1_is_the_closed_form():
    """The shipped files (torch's Schedule1F1B and ScheduleInterleavedZeroBubble, one stage per
    rank: tools/make_schedules.py) pass; ZB-H1 at f = b = w = 1 is 3m + p - 1 units."""
    from labkit.labs.pp.custom import shipped

    rows = {name: read_schedule(path) for name, path in shipped().items()}
    assert ps.torch_problem(lambda p, m: rows["1f1b-p4-m8"], 4, 8, "1f1b") == ""
    assert ps.order_problem(lambda p, m: rows["1f1b-p4-m8"], 4, 8) == ""
    torch_zb = lambda p, m: rows["zbh1-p4-m8"]         # noqa: E731
    assert [c(torch_zb, 4, 8) for c in (ps.split_problem, ps.memory_problem,
                                        ps.bubble_problem)] == ["", "", ""]
    assert ps.zbh1_closed_form(4, 8) == (pytest.approx(3 / 27), pytest.approx(27))
    assert ps.zbh1_closed_form(8, 16)[1] == pytest.approx(3 * 16 + 7)
    # each rank of torch's ZB-H1 holds at most p micro-batches whose W is still to run
    assert [ps.pending_weight_peak(r) for r in rows["zbh1-p4-m8"].values()] == [4, 4, 4, 4]


# ------------------------------------------------------- wrong answers, each named precisely

def torch_1f1b(fn, p, m):
    return ps.torch_problem(fn, p, m, "1f1b")


def torch_zbh1(fn, p, m):
    return ps.torch_problem(fn, p, m, "zbh1")


WRONG_1F1B = [
    (stub, torch_1f1b, "exercise not attempted yet: stub(4, 8) still raises "
                             "NotImplementedError(Exercise write_1f1b"),
    (backward_first, torch_1f1b,
     "torch's check: rank 1, step 0: 1B0 (full backward of stage 1, micro-batch 0) comes before "
     "its forward 1F0 (rank 1, step 3): a backward needs the activations its forward saved"),
    (warm_up_reversed, torch_1f1b,
     "torch's check: deadlock between ranks 0 and 1: each waits for another, so no rank can go "
     "on. rank 0 stops at step 1 (0B0): it needs the gradient of 1I0 or 1B0, which rank 1 runs "
     "at step 2; rank 1 stops at step 1 (1F1): it needs the activations of 0F1"),
    (split_1f1b, torch_1f1b, "rank 0, step 4: 0I0 is a split backward (I: input "
                                   "gradient); 1F1B here runs each backward whole, as one B"),
    (shifted_stages, torch_1f1b, "rank 0, step 0: 1F0 is stage 1's; with one stage per "
                                       "rank, rank r runs stage r's actions only"),
    (only_rank_0, torch_1f1b,
     "has rows for ranks 0; p = 4 ranks need one row each"),
    (a_string, torch_1f1b, "returned '0F0' (a str); expected a dict {rank: [action, ...]}"),
    (gpipe, ps.order_problem, "rank 0 holds 8 micro-batches at its peak (forwarded, not yet "
                              "backward); 1F1B holds at most min(p - r, m) = 4 there"),
    (one_at_a_time, ps.order_problem, "rank 0 holds at most 1 micro-batch at a time; 1F1B's "
                                      "warm-up fills the pipeline to min(p - r, m) = 4 there"),
    (cool_down_reversed, ps.order_problem,
     "at f = 1, b = 2 its simulated step takes 37 units, 1F1B's 33 units: rank 0 waits 13 units "
     "of it, where every rank of 1F1B waits (p - 1)(f + b) = 9 units"),
    (backward_first, ps.order_problem, "not a schedule torch runs, so it cannot be timed: "
                                       "torch's check: rank 1, step 0: 1B0"),
]

WRONG_ZBH1 = [
    (missing_w, ps.split_problem, "rank 2 has no W (weight gradient) of micro-batch 7"),
    (missing_w, torch_zbh1, "torch's check: stage 2 has 8 input gradients (I) and 7 weight "
                                  "gradients (W): micro-batch 7 has I without W"),
    (write_1f1b, ps.split_problem, "rank 0, step 4: 0B0 is a full backward (B); ZB-H1 splits "
                                   "every backward into I (input gradient) and W"),
    (w_before_i, torch_zbh1, "torch's check: rank 0, step 4: the weight gradient 0W0 comes "
                                   "before the input gradient 0I0 (it runs later, at step 5)"),
    (all_ws_last, ps.memory_problem, "rank 0 holds 8 micro-batches whose W has not run yet at "
                                     "its peak; a W needs its micro-batch's saved inputs"),
    (one_more_warm_up, ps.memory_problem, "rank 0 holds 5 micro-batches at its peak (forwarded, "
                                          "input gradient not yet run); ZB-H1 keeps 1F1B's "
                                          "bound, min(p - r, m) = 4 there"),
    (ws_at_once, ps.bubble_problem, "at f = b = w = 1 its simulated step takes 30 units, 20.0% "
                                    "of it idle; ZB-H1's closed form (Qi et al. 2024, §3.1) is "
                                    "27 units, 11.1% idle (1F1B: 27.3%): rank 0 waits 6 units, "
                                    "where every rank of ZB-H1 waits 3 units"),
    (split_1f1b, ps.bubble_problem, "takes 30 units"),
]

# an answer given away: two or more actions in a row, as a schedule's row would show them
_ROW = re.compile(r"\d+[FIBW]\d+[ ,]+\d+[FIBW]\d+")


@pytest.mark.parametrize("fn, check, words", WRONG_1F1B + WRONG_ZBH1,
                         ids=[f"{fn.__name__}-{check.__name__}" for fn, check, _ in
                              WRONG_1F1B + WRONG_ZBH1])
def test_wrong_answers_fail_with_the_mistake_named(fn, check, words):
    why = check(fn, 4, 8)
    assert words in why, why
    assert not _ROW.search(why), f"the message shows a schedule: {why}"


def test_a_wrong_answer_fails_its_check_cell():
    """What the check cells do with a problem: grading.check fails with the sentence."""
    why = ps.order_problem(gpipe, 4, 8)
    with pytest.raises(grading.GradingError, match=r"write_1f1b\(4, 8\): 1F1B's memory and step: "
                                                   r"rank 0 holds 8 micro-batches"):
        grading.check("write_1f1b(4, 8): 1F1B's memory and step", not why, why)


def test_a_refusal_of_the_grader_is_not_turned_into_a_message():
    from labkit.course.fence import ForbiddenCall

    def refused(p, m):
        raise ForbiddenCall("your write_zbh1 calls labkit.pipeline.simulate; write it yourself")

    with pytest.raises(ForbiddenCall):
        ps.split_problem(refused, 4, 8)


# ----------------------------------------------------------------------------- on 4 ranks

def test_schedules_that_fail_a_check_are_not_launched(monkeypatch):
    import labkit.runtime.launch as launch

    monkeypatch.setattr(launch, "run_lab", lambda *a, **k: pytest.fail("launched ranks"))
    runs = ps.run_schedules(write_1f1b=stub, write_zbh1=missing_w)
    assert runs.rows == {}
    assert runs.problem("write_1f1b").startswith("exercise not attempted yet")
    assert "has I without W" in runs.problem("write_zbh1")
    assert "write_zbh1: not run: torch's check: stage 2" in runs.summary()
    runs = ps.run_schedules(write_1f1b=stub, write_zbh1=None)       # a cell that was refused
    assert runs.problem("write_zbh1") == ("write_zbh1 is not defined: run its exercise's cell "
                                          "first")


def test_a_run_whose_loss_differs_names_it():
    row = {"loss_diff": 3e-2, "grad_max_diff": 1e-1}
    runs = ps.ScheduleRuns(rows={"write_1f1b": row})
    assert "its loss differs from one process's by 3.0e-02" in runs.problem("write_1f1b")
    assert "the lab returned no row" in runs.problem("write_zbh1")
