"""Module 09's exercises: the references the check cells compare with (each against a closed form
written here), the checks' messages for the usual wrong answers (each names its mistake), and
the graded notebook (untouched stubs fail; wrong answers fail with those messages)."""
from __future__ import annotations

import math

import pytest

from labkit import pipeline
from labkit.course import grading, reference
from labkit.hardware import GPUS, LINKS
from labkit.models import get_model

# ------------------------------------------------------------------------------ references


@pytest.mark.parametrize("n, stage, dp", [(7e9, 0, 8), (7e9, 1, 8), (7e9, 2, 8), (7e9, 3, 8),
                                          (175e9, 1, 1024), (1e6, 3, 1)])
def test_states_gb_is_16_bytes_with_zero_sharding(n, stage, dp):
    w, g, o = 2, 2, 12
    per_param = (w / (dp if stage >= 3 else 1) + g / (dp if stage >= 2 else 1)
                 + o / (dp if stage >= 1 else 1))
    assert reference.states_gb(n, stage, dp) == pytest.approx(per_param * n / 1e9, rel=1e-12)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (2, 1), (1, 4), (16, 64)])
def test_bubble_share_is_the_simulated_idle_share(p, m):
    assert reference.bubble_share(p, m) == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)
    for schedule in ("gpipe", "1f1b"):
        assert pipeline.simulate(schedule, p, m).bubble_fraction == pytest.approx(
            reference.bubble_share(p, m), abs=1e-12)
    assert reference.pp_min_microbatches(8, 0.05) == 133      # 7 (1 - t) / t = 133


@pytest.mark.parametrize("S, n, link", [(14e9, 8, "nvlink4"), (1e9, 64, "ib-ndr"),
                                        (5e6, 2, "pcie4")])
def test_all_reduce_seconds_closed_form(S, n, link):
    k = LINKS[link]
    want = 2 * (n - 1) * k.latency + 2 * (n - 1) / n * S / k.bandwidth
    assert reference.all_reduce_seconds(S, n, link) == pytest.approx(want, rel=1e-12)


def test_design_references_closed_form():
    spec, peak = get_model("llama3-70b"), GPUS["h100-sxm"].flops("bf16")
    per_token = (6 * (spec.num_params() - spec.embedding_params())
                 + 12 * spec.num_layers * spec.q_size * 8192)
    tokens = 30 * 86_400 * 512 * peak * 0.4 / per_token
    assert reference.trainable_tokens("llama3-70b", 512, "h100-sxm", 30, 0.4, 8192) == \
        pytest.approx(tokens, rel=1e-12)
    assert reference.reported_mfu("llama3-70b", 2e5, 256, "h100-sxm", 8192) == \
        pytest.approx(per_token * 2e5 / (256 * peak), rel=1e-12)
    minutes = math.sqrt(2 * 12 * spec.num_params() / 100e9 * 86_400 / (512 * 1e-4)) / 60
    assert reference.checkpoint_minutes("llama3-70b", 512, 1e-4, 100e9) == \
        pytest.approx(minutes, rel=1e-12)
    chinchilla = 20 * spec.num_params()
    gpus = reference.gpus_for_tokens("llama3-70b", chinchilla, "h100-sxm", 30, 0.4, 8192)
    assert gpus == math.ceil(chinchilla / (tokens / 512))


# ----------------------------------------------- wrong answers: each message names its mistake
# (module level, plausible learner code)

def states_gib(n, stage, dp):
    return reference.states_gb(n, stage, dp) * 1e9 / 2**30


def states_all_sharded(n, stage, dp):
    return 16 * n / dp / 1e9 if stage else 16 * n / 1e9


def bubble_relative(p, m):
    return (p - 1) / m


def bubble_off_by_one(p, m):
    return (p - 1) / (m + p)


def all_reduce_bidirectional(S, n, link):
    k = LINKS[link]
    return 2 * (n - 1) * k.latency + 2 * (n - 1) / n * S / k.bidirectional


def all_reduce_as_all_gather(S, n, link):
    k = LINKS[link]
    return (n - 1) * k.latency + (n - 1) / n * S / k.bandwidth


def mfu_sparse_peak(model, tps, gpus, gpu, s):
    return reference.reported_mfu(model, tps, gpus, gpu, s) / 2


def mfu_6n_only(model, tps, gpus, gpu, s):
    spec = get_model(model)
    return 6 * (spec.num_params() - spec.embedding_params()) * tps / (
        gpus * GPUS[gpu].flops("bf16"))


def tokens_6n_only(model, gpus, gpu, days, mfu, s):
    spec = get_model(model)
    return days * 86_400 * gpus * GPUS[gpu].flops("bf16") * mfu / (
        6 * (spec.num_params() - spec.embedding_params()))


def checkpoint_seconds(model, gpus, rate, bw):
    return 60 * reference.checkpoint_minutes(model, gpus, rate, bw)


def checkpoint_one_gpu(model, gpus, rate, bw):
    return reference.checkpoint_minutes(model, 1, rate, bw)


def checkpoint_16_bytes(model, gpus, rate, bw):
    write = 16 * get_model(model).num_params() / bw
    return math.sqrt(2 * write * 86_400 / (gpus * rate)) / 60


def min_microbatches_relative(p, target, chunks=1):
    """07's usual slip: the target met by (p-1)/(v m), the bubble relative to the ideal time."""
    m = math.ceil((p - 1) / (chunks * target))
    return m if chunks == 1 else -(-m // p) * p


def no_answer(*args):
    raise NotImplementedError("Exercise: write ~5 lines")


CASES = {
    "states_gb": ([(7e9, 1, 8), (70e9, 3, 64)], reference.states_gb),
    "bubble": ([(4, 8), (8, 32)], reference.bubble_share),
    "all_reduce_seconds": ([(14e9, 8, "nvlink4"), (1e9, 64, "ib-ndr"),
                            (1e8, 1024, "eth-400g")], reference.all_reduce_seconds),
    "reported_mfu": ([("llama3-70b", 2e5, 256, "h100-sxm", 8192)], reference.reported_mfu),
    "trainable_tokens": ([("llama3-70b", 512, "h100-sxm", 30, 0.4, 8192)],
                         reference.trainable_tokens),
    "checkpoint_minutes": ([("llama3-70b", 512, 1e-4, 100e9)], reference.checkpoint_minutes),
    # 07's check cell's cases
    "min_microbatches": ([(4, 0.08), (8, 0.06), (8, 0.3), (2, 0.03), (16, 0.13), (4, 0.9),
                          ((4, 0.08), {"chunks": 2}), ((8, 0.06), {"chunks": 4}),
                          ((8, 0.3), {"chunks": 2})], reference.pp_min_microbatches),
}


@pytest.mark.parametrize("name, wrong, words", [
    ("states_gb", states_gib, "GiB instead of GB"),
    ("states_gb", states_all_sharded, "each ZeRO stage shards only some of the states"),
    ("bubble", bubble_relative, "(p-1)/m is the bubble relative to the ideal time"),
    ("bubble", bubble_off_by_one, "the step's length counts one slot too many"),
    ("all_reduce_seconds", all_reduce_bidirectional, "the bidirectional figure"),
    ("all_reduce_seconds", all_reduce_as_all_gather, "one all-gather (or reduce-scatter) alone"),
    ("reported_mfu", mfu_sparse_peak, "the peak with sparsity"),
    ("reported_mfu", mfu_6n_only, "6N only: the attention FLOPs per token are missing"),
    ("trainable_tokens", tokens_6n_only, "6N only: the attention FLOPs per token are missing"),
    ("checkpoint_minutes", checkpoint_seconds, "seconds, not minutes"),
    ("checkpoint_minutes", checkpoint_one_gpu, "one GPU's MTBF, not the job's"),
    ("checkpoint_minutes", checkpoint_16_bytes, "counted with the training states it does not "
                                                "save"),
    ("min_microbatches", min_microbatches_relative, "the bubble relative to the ideal time, not "
                                                    "by the idle share of the step"),
])
def test_a_usual_mistake_is_named(name, wrong, words):
    cases, ref = CASES[name]
    rtol = 0.02 if name in ("trainable_tokens", "checkpoint_minutes") else 1e-9
    with pytest.raises(grading.GradingError) as err:
        reference.check_with_mistakes(name, wrong, cases, ref, rtol=rtol)
    text = str(err.value)
    assert "that is a known mistake: " in text and words in text, text
    assert "expected:" in text and "received:" in text         # the usual comparison stays


def test_gib_is_also_flagged_by_the_ratio_and_a_right_answer_passes(capsys):
    with pytest.raises(grading.GradingError, match=r"GB vs GiB\?"):
        reference.check_with_mistakes("states_gb", states_gib, *CASES["states_gb"])
    reference.check_with_mistakes("states_gb", reference.states_gb, *CASES["states_gb"])
    assert "✓ states_gb" in capsys.readouterr().out


def test_an_unknown_wrong_answer_or_a_stub_gets_the_plain_message():
    with pytest.raises(grading.GradingError) as err:
        reference.check_with_mistakes("bubble", lambda p, m: 0.5, *CASES["bubble"])
    assert "known mistake" not in str(err.value) and "wrong result for" in str(err.value)
    with pytest.raises(grading.GradingError, match="not attempted yet"):
        reference.check_with_mistakes("bubble", no_answer, *CASES["bubble"])
    assert reference.known_mistake(no_answer, CASES["bubble"][0], reference.bubble_share,
                                   reference.MISTAKES["bubble"]) is None


def test_every_listed_mistake_differs_from_the_answer_on_the_notebook_cases():
    """A mistake that equals the reference on every case could never be named."""
    for name, (cases, ref) in CASES.items():
        for label, wrong in reference.MISTAKES[name]:
            calls = [reference._args(c) for c in cases]
            assert any(not math.isclose(wrong(*a, **k), ref(*a, **k), rel_tol=0.02)
                       for a, k in calls), label


# ---------------------------------------------------------------- the notebook, graded

@pytest.mark.notebook
def test_untouched_exercises_fail_and_wrong_answers_are_named(tmp_path):
    """Graded through `labkit grade`: every stub fails as not attempted; a learner who answers
    in GiB and with (p-1)/m is told so by name."""
    import nbformat

    from labkit.course import exercises as ex, grader

    solution = ex.REPO_ROOT / "solutions" / "09_interview_prep.ipynb"
    path = tmp_path / "09_interview_prep.ipynb"
    path.write_text(ex.render_path(solution), encoding="utf-8")
    report = grader.grade_notebook(path, template=solution, timeout=120)
    assert not report.ok and not any(c.passed for c in report.checks), report.format()
    assert all("not attempted" in c.message for c in report.checks), report.format()

    nb = ex.read_notebook(path)
    lay = ex.layout(nb)
    nb.cells[lay.exercise("states").index].source = (
        "def states_gb(num_params, zero_stage, dp):\n"
        "    per = {0: 16, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[zero_stage]\n"
        "    return per * num_params / 2**30\n\n\n"
        "llama70_zero3_64 = states_gb(get_model('llama3-70b').num_params(), 3, 64)")
    nb.cells[lay.exercise("bubble").index].source = (
        "def bubble(stages, microbatches):\n    return (stages - 1) / microbatches\n\n\n"
        "m_for_5pct_p8 = 140")
    nbformat.write(nb, str(path))
    report = grader.grade_notebook(path, template=solution, timeout=120)
    verdict = {c.name: c for c in report.checks}
    assert not verdict["states"].passed and "GiB instead of GB" in verdict["states"].message
    assert not verdict["bubble"].passed and "(p-1)/m" in verdict["bubble"].message
