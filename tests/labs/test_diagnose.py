"""Module 09's "diagnose this run" cases (labkit.labs.diagnose, labkit.plots.diagnose).

Pure tests first (plans, answers, figures: nothing launched). Then every case is built once on
gloo ranks (a module cache shared by the assertions about it) and its evidence is checked for
what the question relies on, with expected values computed here: GPT-2's parameter count, the
Korthikanti et al. layer formula, the bubble (p-1)/(m+p-1), each rank's share of an uneven data
split. Timing assertions only where a sleep guarantees them (the machine is shared), and one
where the case's premise needs it (18 tiny all-reduces are slower than one).
"""
from __future__ import annotations

import os

import re
import uuid

import pytest

from labkit.labs.diagnose import CASES, Case, build, plan
from proctools import MARK, wait_until_gone

MARKER = f"diagnose-{uuid.uuid4().hex[:8]}"
_built: dict = {}


def case(name: str) -> Case:
    """Case `name` built once for this module (seed 0), its ranks marked with MARKER."""
    if name not in _built:
        _built[name] = build(name, seed=0, env={MARK: MARKER})
    return _built[name]


def gpt2_params(layers: int, h: int, vocab: int = 1024, positions: int = 64) -> int:
    """transformers' GPT-2 with tied embeddings: per layer 2 LayerNorms (4h), c_attn (3h^2+3h),
    attn c_proj (h^2+h), c_fc (4h^2+4h), mlp c_proj (4h^2+h); wte, wpe, the final LayerNorm."""
    per_layer = 4 * h + 3 * h * h + 3 * h + h * h + h + 4 * h * h + 4 * h + 4 * h * h + h
    return vocab * h + positions * h + layers * per_layer + 2 * h


# ---------------------------------------------------------------------------------------------
# pure: plans, answers, figures

def test_plan_depends_on_the_seed_only():
    for name in CASES:
        a, b = plan(name, 3), plan(name, 3)
        assert a == b
        assert len(set(a["options"])) == len(a["options"]) >= 4
        assert 0 <= a["answer"] < len(a["options"])
    # the seed shuffles the options: over ten seeds the right answer is not always first
    answers = {plan("slow-steps", s)["answer"] for s in range(10)}
    assert len(answers) > 1, answers


def test_bad_input_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match=r"name='stragler' is not supported; allowed: "
                                         r"'slow-steps'"):
        build("stragler")
    for seed in (-1, True, 1.5, 2**31):
        with pytest.raises(ValueError, match="seed="):
            plan("slow-steps", seed)
    with pytest.raises(ValueError, match="timeout="):
        build("slow-steps", timeout=0)


def test_case_names_do_not_give_the_answer_away():
    """`straggler` was the name of the case whose answer is (a) "Rank 0 is a straggler": a name
    says what the run shows (words of its question), never a word only the right option has."""
    from labkit.labs.diagnose.lab import ALIASES

    for name in CASES:
        p = plan(name, 0)
        right = p["options"][p["answer"]].lower()
        others = " ".join(o.lower() for i, o in enumerate(p["options"]) if i != p["answer"])
        seen = (p["title"] + " " + p["question"]).lower()
        for word in re.findall(r"[a-z]+", name):
            assert word not in right or word in others or word in seen, (name, word, right)
    p = plan("straggler", 0)                  # the first name did give it away
    assert "straggler" in p["options"][p["answer"]] and "straggler" not in p["question"]
    assert set(ALIASES.values()) == set(CASES) and not set(ALIASES) & set(CASES)


def test_first_names_are_still_accepted_and_draw_the_same_case():
    """Module 09's exercise and the README still use the first names (build("straggler"))."""
    from labkit.labs.diagnose.lab import ALIASES

    for old, new in ALIASES.items():
        for seed in (0, 1, 3):
            a, b = plan(old, seed), plan(new, seed)
            assert a.pop("name") == old and b.pop("name") == new and a == b


# ---- the command line: checked before any lab runs; asks on a terminal ----------------------

class _Terminal:
    """A stdin that is a terminal, reading the given lines."""

    def __init__(self, text: str):
        import io
        self._f = io.StringIO(text)

    def isatty(self):
        return True

    def readline(self):
        return self._f.readline()


def _fake_case(name, seed=0, **_):
    p = plan(name, seed)
    return Case(name=name, title=p["title"], question=p["question"], options=p["options"],
                answer=p["answer"], why=[f"why {i}" for i in range(len(p["options"]))],
                evidence={"log": "[rank 0] the log"}, seed=seed)


@pytest.fixture
def no_labs(monkeypatch):
    """build() replaced by the plan's case with no lab run; the calls it got."""
    calls = []

    def fake(name, seed=0, **kw):
        calls.append(name)
        return _fake_case(name, seed)
    monkeypatch.setattr("labkit.labs.diagnose.lab.build", fake)
    return calls


@pytest.mark.parametrize("argv, message", [
    (["slow-steps", "--answer", "z"], "--answer='z' is not one of the options; allowed: a "
                                      "letter a, b, c, d"),
    (["slow-steps", "--answer", ""], "--answer='' is not one of the options"),
    (["slow-steps", "--answer", "1"], "--answer='1' is not one of the options"),
    (["stragglr"], "name='stragglr' is not supported; allowed: 'slow-steps'"),
    (["slow-steps", "--seed", "-1"], "seed=-1 must be a whole number"),
])
def test_bad_arguments_are_refused_before_any_lab_runs(argv, message, no_labs, capsys):
    from labkit.labs.diagnose.lab import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert no_labs == []


def test_the_help_lists_only_the_neutral_names(capsys):
    from labkit.labs.diagnose.lab import ALIASES, main

    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split()).replace("- ", "-")   # unwrapped
    assert all(name in shown for name in CASES)
    assert not any(old in shown for old in ALIASES)


def test_on_a_terminal_it_asks_until_it_gets_a_letter(no_labs):
    import io

    from labkit.labs.diagnose.lab import main

    p = plan("slow-steps", 0)
    right = "abcdefgh"[p["answer"]]
    out = io.StringIO()
    main(["slow-steps"], stdin=_Terminal(f"\nzz\n{right}\n"), out=out)
    shown = out.getvalue()
    assert no_labs == ["slow-steps"] and p["question"] in shown and "[rank 0] the log" in shown
    assert shown.count("your answer (a, b, c, d)> ") == 3
    assert shown.count("is not one of the options") == 2
    assert shown.rstrip().endswith(f"Right: ({right}) why {p['answer']}")


def test_piped_it_says_how_to_answer_and_with_answer_it_checks(no_labs):
    import io

    from labkit.labs.diagnose.lab import main

    out = io.StringIO()
    main(["straggler", "--seed", "1"], stdin=io.StringIO("a\n"), out=out)   # not a terminal
    shown = out.getvalue()
    assert "your answer" not in shown and "Right" not in shown and "Not:" not in shown
    assert ("To check an answer: python -m labkit.labs.diagnose slow-steps --seed 1 --answer "
            "LETTER") in shown
    p = plan("slow-steps", 1)
    wrong = next(c for i, c in enumerate("abcd") if i != p["answer"])
    out = io.StringIO()
    main(["slow-steps", "--seed", "1", "--answer", wrong.upper()], stdin=io.StringIO(""),
         out=out)
    assert out.getvalue().rstrip().endswith(f"Not: ({wrong}) why {'abcd'.index(wrong)}")


def test_check_takes_letters_and_indices():
    c = Case(name="x", title="t", question="q?", options=["right", "wrong", "also wrong"],
             answer=0, why=["Yes: 1 ms", "No: 2 ms", "No: 3 ms"], evidence={})
    assert c.check("a") == c.check(0) == c.check("(A)") == (True, "Right: (a) Yes: 1 ms")
    assert c.check("c") == (False, "Not: (c) No: 3 ms")
    assert "(b) wrong" in c.text()
    for bad in ("d", 3, -1, True, None, "ab"):
        with pytest.raises(ValueError, match=r"answer=.*allowed: a letter a, b, c"):
            c.check(bad)
    assert c.figure() is None          # no drawable evidence


def test_evidence_figure_draws_one_panel_per_key():
    from labkit.plots.diagnose import evidence_figure, fmt_size

    ev = dict(step_times={"rank 0": [0.01, 0.02], "rank 1": [0.01, 0.03]}, fault_from=1,
              timeline=[dict(rank=0, kind="forward", start=0.0, end=0.01),
                        dict(rank=1, kind="waiting in barrier", start=0.0, end=0.5, step=2)],
              memory=dict(budget=10e6, by_batch={1: {"parameters": 1e6, "activations": 2e6},
                                                 2: {"parameters": 1e6, "activations": 12e6}},
                          failed=2))
    assert len(evidence_figure(ev).axes) == 3
    assert evidence_figure({"log": "text"}) is None
    with pytest.raises(ValueError, match="end >= start"):
        evidence_figure({"timeline": [dict(rank=0, kind="x", start=1.0, end=0.5)]})
    assert fmt_size(21_860_352) == "21.86 MB (20.85 MiB)"
    assert fmt_size(80e9) == "80.00 GB (74.51 GiB)"


# ---------------------------------------------------------------------------------------------
# every case, built on ranks

@pytest.mark.multirank
@pytest.mark.parametrize("name", CASES)
def test_case_answers_check_and_figure(name):
    c = case(name)
    p = plan(name, 0)
    assert (c.question, c.options, c.answer) == (p["question"], p["options"], p["answer"])
    assert c.check(c.answer)[0] and c.check(c.letters[c.answer])[0]
    for i in range(len(c.options)):
        if i != c.answer:
            ok, message = c.check(i)
            assert not ok and message.startswith(f"Not: ({c.letters[i]}) No: ")
            assert re.search(r"\d", message), message          # cites a number
    assert c.evidence["log"].strip()
    assert c.figure()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multirank
def test_straggler_every_rank_waits_for_the_slow_one():
    c = case("slow-steps")
    n, params = c.numbers, plan("slow-steps", 0)
    sleep, slow = n["sleep"], n["slow_rank"]
    assert f"Rank {slow} is a straggler" in params["options"][params["answer"]]
    extra = [e for e in c.evidence["timeline"] if e["kind"] == "extra work"]
    assert extra and {e["rank"] for e in extra} == {slow}
    assert all(e["end"] - e["start"] >= sleep for e in extra)      # a sleep of `sleep` s
    after = {k: v[c.evidence["fault_from"]:] for k, v in c.evidence["step_times"].items()}
    medians = [sorted(v)[len(v) // 2] for v in after.values()]
    assert all(t >= sleep for t in medians)                        # every rank is slow
    assert max(medians) - min(medians) < 0.25 * sleep              # ... about equally
    # labkit.scaling.straggler: every rank takes the slowest rank's work
    work = [b + (n["extra_s"] if r == slow else 0.0) for r, b in enumerate(n["healthy_step_s"])]
    assert n["predicted_step_s"] == pytest.approx(max(work))
    # the all-reduce did not change: one call (25 MiB bucket) of every fp32 gradient
    grads = 4 * gpt2_params(2, 64)
    assert n["allreduce_calls"] == {"healthy": 1, "straggler": 1}
    assert n["allreduce_bytes"] == {"healthy": grads, "straggler": grads}


@pytest.mark.multirank
def test_small_buckets_many_calls_same_bytes():
    c = case("bucket-slowdown")
    n = c.numbers
    grads = 4 * gpt2_params(4, 64)
    assert n["gradient_bytes"] == grads
    assert n["allreduce_bytes"] == {"small": grads, "default": grads}
    assert n["allreduce_calls"]["default"] == 1
    assert n["allreduce_calls"]["small"] == len(n["torch_buckets"]["small"])
    assert 1 < n["allreduce_calls"]["small"] <= 12 * 4 + 4          # at most one per tensor
    assert sum(n["torch_buckets"]["small"]) == grads
    # The case's premise, measured as the shortest of 12 interleaved steps each (about 2x apart
    # with two CPU burners). At load 10 it came out 50.1 vs 50.7 ms once: a machine that busy
    # can hide 17 extra all-reduces in one run, so a flipped premise is measured once more.
    steps = n["step_s"]
    if not steps["small"] > steps["default"]:
        steps = build("bucket-slowdown", seed=0, env={MARK: MARKER}).numbers["step_s"]
    assert steps["small"] > steps["default"], (
        f"small buckets' shortest step {1e3 * steps['small']:.1f} ms is not above the default's "
        f"{1e3 * steps['default']:.1f} ms, twice in a row (load {os.getloadavg()[0]:.1f})")
    # small buckets start during the backward; the one default bucket when it has ended
    first, end = n["first_allreduce_s"], n["backward_end_s"]
    assert first["small"] < end["small"]
    assert first["small"] - end["small"] < first["default"] - end["default"]


@pytest.mark.multirank
def test_few_microbatches_idle_share_follows_the_bubble():
    c = case("idle-pipeline")
    n = c.numbers
    p, few, many = n["stages"], n["microbatches"], n["more_microbatches"]
    for m in (few, many):
        assert n["idle_formula"][m] == pytest.approx((p - 1) / (m + p - 1))
    assert n["idle_measured"][few] > n["idle_measured"][many]
    assert n["idle_measured"][few] >= n["idle_formula"][few] - 0.03   # the bubble is structural
    runs = list(c.evidence["pipeline"].values())
    assert [len(r) for r in runs] == [2 * p * few, 2 * p * many]     # an F and a B each


@pytest.mark.multirank
def test_activation_oom_error_and_memory():
    c = case("out-of-memory")
    n, mem = c.numbers, c.evidence["memory"]
    budget, seq, failed = n["budget"], n["seq"], n["failed_batch"]
    assert n["error_type"] == "OutOfMemoryError"
    assert "Tried to allocate" in c.evidence["error"] and f"{budget:,} B" in c.evidence["error"]
    # the whole traceback (run_lab keeps a long one in a file: read back, the file removed)
    assert "the whole message:" not in c.evidence["log"]
    assert "raise torch.OutOfMemoryError(" in c.evidence["log"]
    assert mem["budget"] == budget and mem["failed"] == failed
    assert all(n["peak"][b] <= budget for b in n["peak"])          # the steps that ran fitted
    assert failed not in n["peak"] and n["needed"] > budget
    acts = n["activations"]
    assert 1.8 < acts[4] / acts[2] < 2.2 and 1.8 < acts[2] / acts[1] < 2.2
    # Korthikanti et al. 2022, Table 2, no recompute: s b h (34 + 5 a s / h)
    assert n["layer_activations_predicted"] == pytest.approx(
        seq * failed * 64 * (34 + 5 * 4 * seq / 64))
    assert 0.95 < n["ratio"][4] < 1.05
    assert n["model_states"] < 0.2 * budget                        # not the weights
    assert n["sharded_needed"] > budget


@pytest.mark.multirank
def test_skipped_collective_hangs_then_times_out_and_leaves_nothing():
    c = case("hang-then-timeout")
    n = c.numbers
    world, batch, samples = n["world_size"], n["batch"], n["samples"]
    steps = [len(range(r, samples, world)) // batch for r in range(world)]
    assert n["steps_per_rank"] == steps and steps[0] == steps[1] + 1
    assert n["waiting_in"] == ["all_reduce", "barrier"]
    assert n["allreduces_entered"] == [steps[0], steps[1]]
    assert "Timed out waiting 3000ms" in c.evidence["error"]
    assert all(code not in (0, None) for code in n["exit_codes"])
    assert n["sampler_samples_per_rank"] == -(-samples // world)
    assert "finished my" in c.evidence["log"]
    for name in CASES:                   # whatever ran before this: nothing of it is left
        case(name)
    waited, left = wait_until_gone(MARKER, 10.0)
    assert left == [], f"processes of the cases survived them: {left}"


@pytest.mark.multirank
def test_the_same_seed_gives_the_same_question_twice():
    first = case("out-of-memory")
    again = build("out-of-memory", seed=0, env={MARK: MARKER})
    assert (again.question, again.options, again.answer) == (first.question, first.options,
                                                             first.answer)
    assert again.numbers["budget"] == first.numbers["budget"]      # drawn, not measured


@pytest.mark.multirank
def test_a_peer_closed_race_runs_the_hang_again_once(monkeypatch):
    """Under load gloo may close the timed-out rank's connections before that rank records its
    timeout, so the first error is its peer's 'Connection closed by peer': the case runs the
    lab once more (and gives up, with that error, if the second run does the same)."""
    from labkit.labs.diagnose import failures
    from labkit.runtime.results import LabError

    race = LabError("rank 0 raised RuntimeError: Connection closed by peer", reason="exception",
                    rank=0, exc_type="RuntimeError",
                    exc_message="[pair.cc:553] Connection closed by peer [127.0.0.1]:36569")
    real, calls = failures.launch, []

    def first_a_race(*args, **kwargs):
        calls.append(args[0])
        return (None, race) if len(calls) == 1 else real(*args, **kwargs)
    monkeypatch.setattr(failures, "launch", first_a_race)
    c = build("hang-then-timeout", seed=0, env={MARK: MARKER})        # not the cached one
    assert len(calls) == 2 and "Timed out waiting" in c.evidence["error"]

    calls.clear()
    monkeypatch.setattr(failures, "launch", lambda *a, **k: calls.append(a[0]) or (None, race))
    with pytest.raises(LabError, match="Connection closed by peer"):
        build("hang-then-timeout", seed=0, env={MARK: MARKER})
    assert len(calls) == 2
