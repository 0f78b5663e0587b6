"""The hints the graders give (issue 28, item 10): a hint names the concept or the mistake, never
the code or the number that is the answer. 03's straggler hint was `1 - 1 / (1 + x), not x`,
loss_40's `1 - 1/1.4 = 0.2857`: checked here for labkit's own hints, the named mistakes of
`labkit.course.reference.MISTAKES` and the diagnosis checks' hints, against the answers of the
check cells' cases."""
from __future__ import annotations

import math
import re

import pytest

from labkit.course import grading, reference, reference_trace
from labkit.trace import steps


def _traces(*names):
    """(path, last step) of shipped traces, as solutions/11's check cells pass them."""
    return [(reference_trace.trace_path(n), steps(reference_trace.trace_path(n))[-1]) for n in names]


# each MISTAKES entry's cases, as its check cell passes them (solutions/07, 09, 10 and 11)
CASES = {
    "states_gb": [(7e9, 1, 8), (70e9, 3, 64)],
    "bubble": [(4, 8), (8, 32)],
    "min_microbatches": [(4, 0.08), (8, 0.06), (8, 0.3), (2, 0.03), (16, 0.13), (4, 0.9),
                         ((4, 0.08), {"chunks": 2}), ((8, 0.06), {"chunks": 4})],
    "all_reduce_seconds": [(14e9, 8, "nvlink4"), (1e9, 64, "ib-ndr")],
    "reported_mfu": [("llama3-70b", 2e5, 256, "h100-sxm", 8192)],
    "trainable_tokens": [("llama3-70b", 512, "h100-sxm", 30, 0.4, 8192)],
    "checkpoint_minutes": [("llama3-70b", 512, 1e-4, 100e9)],
    "all_to_all_bytes": [(2048, 8, 7168, 2, 1.0), (4096, 2, 4096, 2, 1.25), (4096, 2, 4096, 2),
                         (512, 1, 1024, 4), ((1024, 8, 2048, 1), {"capacity_factor": 1.5}),
                         (3, 1, 10, 4, 1.25)],
    "exposed": [([(0.0, 1.5)], [(1.0, 4.0)]), ([(0.0, 1.0)], [(0.5, 3.0), (1.0, 2.0)]),
                ([(0.0, 2.0), (1.0, 3.0)], [(0.5, 4.0)]), ([], [])],
    "exposed_all_reduce_ms": _traces("ddp-naive-rank1.json", "ddp-torch-onebucket-rank0.json"),
    "collective_seconds": _traces("ddp-straggler-rank0.json", "ddp-torch-rank0.json"),
    "hidden_share": _traces("ddp-bucketed-rank0.json", "ddp-torch-rank0.json"),
}
REFERENCES = {"states_gb": reference.states_gb, "bubble": reference.bubble_share,
              "min_microbatches": reference.pp_min_microbatches,
              "all_reduce_seconds": reference.all_reduce_seconds,
              "reported_mfu": reference.reported_mfu,
              "trainable_tokens": reference.trainable_tokens,
              "checkpoint_minutes": reference.checkpoint_minutes,
              "all_to_all_bytes": reference.all_to_all_bytes,
              "exposed": reference_trace.exposed,
              "exposed_all_reduce_ms": reference_trace.exposed_all_reduce_ms,
              "collective_seconds": reference_trace.collective_seconds,
              "hidden_share": reference_trace.hidden_share}


def significant(x: float) -> set[str]:
    """The first three significant digits of x, rounded and cut ('286' and '285' for 0.2857)."""
    digits = re.sub(r"\D", "", f"{abs(x):.6e}".split("e")[0])
    rounded = re.sub(r"\D", "", f"{abs(x):.2e}".split("e")[0])
    return {digits[:3], rounded[:3]} if x else set()


def test_every_named_mistake_has_its_cases_here():
    assert set(reference.MISTAKES) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_mistake_label_gives_the_answer_or_a_worked_number(name):
    labels = [label for label, _ in reference.MISTAKES[name]]
    answers = set()
    for case in CASES[name]:
        args, kwargs = reference._args(case)
        value = float(REFERENCES[name](*args, **kwargs))
        answers |= {d for d in significant(value) if len(d) == 3}
    for label in labels:
        shown = re.sub(r"\D", "", label)
        leaked = [d for d in answers if d in shown]
        assert not leaked, (name, label, leaked)
        assert not re.search(r"=\s*[\d.]+", label), (name, label)       # no worked arithmetic
        assert "LINKS[" not in label and ".latency" not in label, (name, label)   # no code


def test_the_min_microbatches_mix_up_is_named():
    """07: a learner who solves (p-1)/(v m) <= target (the bubble relative to the ideal time)
    for m is told that the target is the idle share of the step."""
    def relative(p, target, chunks=1):
        m = math.ceil((p - 1) / (chunks * target))
        return m if chunks == 1 else -(-m // p) * p

    with pytest.raises(grading.GradingError) as err:
        reference.check_with_mistakes("min_microbatches", relative, CASES["min_microbatches"],
                                      reference.pp_min_microbatches)
    text = str(err.value)
    assert "that is a known mistake" in text and "relative to the ideal time" in text, text
    assert "idle share of the step" in text


def test_diagnosis_hints_point_at_the_evidence_not_the_answer(monkeypatch):
    """check_diagnosis's hint was the right option's explanation ('the slow rank 0 did 100 ms of
    extra work...'): the answer itself."""
    from labkit.labs.diagnose import Case

    case = Case(name="slow-steps", title="t", question="q", options=["a", "b"], answer=0,
                why=["Yes: rank 1 did 100 ms of extra work", "No: it did not"],
                evidence={"timeline": []}, numbers={"slow_rank": 1})
    monkeypatch.setattr(reference, "diagnosis_case", lambda name, seed: case)
    for truth, fn in (("name", lambda ev: "idle-pipeline"), ("slow_rank", lambda ev: 0)):
        with pytest.raises(grading.GradingError) as err:
            reference.check_diagnosis(truth, fn, "slow-steps", truth)
        text = str(err.value)
        assert reference.DIAGNOSIS_HINTS[truth] in text, text
        assert "extra work" not in text.split("look at:")[-1] and "100 ms" not in text
    for hint in reference.DIAGNOSIS_HINTS.values():
        assert not re.search(r"\d", hint), hint
