"""The question bank (labkit.quiz): the engine (load, validate, draw, render, check, score) and
every question in labkit/quiz/data, whoever wrote it.

For every question and three seeds: the answer function returns a finite number (numeric) or
its verify function says the correct option holds (choice); the statement, the explanation,
the options and the article claim render with no placeholder left; the check accepts the expected
answer, bare and with its unit, and rejects one 10 % off. Parametrised questions must draw
different numbers. A few answers are recomputed here in closed form from the primary sources'
formulas, independently of the answer functions.
"""
from __future__ import annotations

import math
import re

import pytest

from labkit.quiz import TOPICS, Attempt, Score, Verdict, get, load_bank, score, select

BANK = load_bank()
SEEDS = (0, 1, 2)
LEFTOVER = re.compile(r"[{}]")


def texts(a: Attempt):
    yield a.statement
    yield a.explanation
    yield from a.options
    if a.article_claim:
        yield from a.article_claim.values()


def wrong_by_ten_percent(a: Attempt) -> float:
    """A value 10 % off the expected one, or further where an absolute tolerance (an integer
    count checked to +-0.4, say) is wider than 10 %."""
    q = a.question
    return a.expected + max(0.1 * abs(a.expected), 2 * q.abs_tolerance)


# ---- the bank as a whole ---------------------------------------------------------------------

def test_bank_size_and_topics():
    assert len(BANK) >= 80, f"the bank has {len(BANK)} questions; issue 20 asks for at least 80"
    counts = {t: sum(q.topic == t for q in BANK) for t in TOPICS}
    thin = {t: n for t, n in counts.items() if n < 5}
    assert not thin, f"topics with fewer than 5 questions: {thin} (all: {counts})"
    assert len({q.id for q in BANK}) == len(BANK)


def test_bank_mixes_kinds_and_difficulties():
    assert {q.kind for q in BANK} == {"numeric", "choice"}
    assert {q.difficulty for q in BANK} == {1, 2, 3}
    numeric = [q for q in BANK if q.kind == "numeric"]
    drawn = [q for q in numeric if math.prod(len(v) for v in q.params.values()) > 1]
    assert len(drawn) >= len(numeric) / 2, "most numeric questions should draw their numbers"


def test_article_claims_cite_their_article_by_title_and_author():
    """The quiz cited `seeds/003_71cd8334a14642c0.txt`, a file learners do not have; each claim
    now names a known article, and the attempt cites it as ARTICLES does."""
    from labkit.quiz.articles import ARTICLES

    claims = [q for q in BANK if q.article_claim]
    assert len(claims) >= 20, f"only {len(claims)} questions carry a popular article's claim"
    assert {q.article_claim["source"] for q in claims} <= set(ARTICLES)
    for q in claims:
        assert q.draw(0).article_claim["source"] == ARTICLES[q.article_claim["source"]]


def _quiz_texts():
    """Every text a learner can see from a question, at three seeds."""
    for q in BANK:
        for seed in SEEDS:
            a = q.draw(seed)
            yield q.id, [*texts(a), a.expected_text]


def test_no_quiz_text_names_seed_files_or_seed_articles():
    from labkit.quiz.articles import ARTICLES

    for qid, shown in _quiz_texts():
        for text in shown:
            assert "seeds/" not in text and "seed article" not in text.lower(), (qid, text)
    for citation in ARTICLES.values():
        assert "seed" not in citation.lower() and ".txt" not in citation


def test_each_claim_is_answered_at_its_own_parameters():
    """Lesson 09 set "600 GB/s bidirectional on H100 NVLink 4.0" beside NVLink 5's 1,800 GB/s
    (seed 0's draw); each claim is now answered at the parameters it states."""
    from labkit.quiz.articles import CLAIM_PARAMS, claim_params
    from labkit.quiz.bank import claim_attempt

    claims = {q.id: claim_attempt(q) for q in BANK if q.article_claim}
    assert set(CLAIM_PARAMS) <= set(claims)
    for qid, a in claims.items():
        assert CLAIM_PARAMS.get(qid, {}).items() <= a.params.items() == claim_params(
            a.question).items(), qid
        assert a.values == a.question.compute(a.params), qid
    got = {qid: claims[qid].expected for qid in CLAIM_PARAMS}
    assert got["hw-nvlink-bidirectional-seed"] == 2 * 450                  # NVLink 4, both ways
    assert get("hw-nvlink-bidirectional-seed").draw(0).expected == 2 * 900  # what it printed
    assert got["hw-nvlink-vs-ib-seed"] == 450 / 25 == 18                    # H100 vs HDR
    assert got["hw-network-port-gbps"] == 400 / 8                           # NDR, in bytes
    assert got["pp-naive-utilisation"] == 100 / 8                           # 8 GPUs: 1/8
    assert got["mem-model-states-unsharded"] == 16 * claims[
        "mem-model-states-unsharded"].params["params_b"]
    assert claims["pp-interleaving-cost"].params["chunks"] == 2
    assert claims["zero-pipeline-deepspeed-seed"].params["stage"] == 3
    with pytest.raises(ValueError, match="carries no article claim"):
        claim_attempt(get("zero-states-per-gpu"))


def test_fourteen_h100s_for_a_round_70b_is_not_listed_as_wrong():
    """ "Distributed Training Strategies": a 70B model needs "at least 14 H100s just for memory":
    16 B x 70e9 / 80 GB = 14 exactly, right (lesson 01 says so); Llama 3 70B's 70.55B need 15.
    (At 80 GiB, 85.9e9 B, both would be 14.)"""
    q = get("mem-min-h100-llama3-70b")
    a = q.draw(0)
    assert q.article_claim is None and a.article_claim is None
    assert a.values["round_ratio"] == 16 * 70e9 / 80e9 == 14
    assert a.expected == 15 == math.ceil(a.values["ratio"])
    assert "is right" in a.explanation and "14 H100s" in a.explanation
    assert not any("14 H100" in (x.article_claim or {}).get("wrong", "") for x in BANK)
    assert math.ceil(16 * 70.55e9 / (80 * 2**30)) == 14


def test_lesson_09_prints_each_claim_beside_its_own_answer(capsys):
    """Run lesson 09's claims cell: every printed answer is claim_attempt's."""
    import json
    from pathlib import Path

    from labkit.hardware import LINKS
    from labkit.quiz.bank import claim_attempt

    nb = json.loads((Path(__file__).parents[2] / "notebooks/09_interview_prep.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
                and "claim_attempt(q)" in "".join(c["source"]))
    exec(cell, {"bank": BANK, "LINKS": LINKS})
    printed = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"\[[^]]+\] (\S+): .*; labkit(?: \((.*?)\))?: (.*)\.$", line)
        if m:
            printed[m.group(1)] = (m.group(2) or "", m.group(3))
    claims = [q for q in BANK if q.article_claim]
    assert set(printed) == {q.id for q in claims}
    for q in claims:
        a = claim_attempt(q)
        right = f"{a.expected:.4g} {a.unit}" if a.kind == "numeric" else a.expected_text
        at = ", ".join(f"{k}={v}" for k, v in a.params.items())
        assert printed[q.id] == (at, right.rstrip(".")), q.id
    assert printed["hw-nvlink-bidirectional-seed"] == ("link=nvlink4", "900 GB/s")


# ---- every question ----------------------------------------------------------------------------

@pytest.mark.parametrize("q", BANK, ids=[q.id for q in BANK])
def test_question(q):
    for seed in SEEDS:
        a = q.draw(seed)
        assert a.kind == q.kind and a.question is q
        for text in texts(a):
            assert text.strip() and not LEFTOVER.search(text), f"{q.id} seed {seed}: {text!r}"
        if q.kind == "numeric":
            assert isinstance(a.expected, float) and math.isfinite(a.expected), a.expected
            assert a.options == []
            for response in (a.expected, repr(a.expected), f"{a.expected!r} {a.unit}".strip()):
                v = a.check(response)
                assert v.correct, f"{q.id} seed {seed}: {response!r} rejected: {v.message}"
            off = wrong_by_ten_percent(a)
            v = a.check(off)
            assert not v.correct, f"{q.id} seed {seed}: {off} (10 % off {a.expected}) accepted"
        else:
            assert q.compute(a.params)["holds"] is True, f"{q.id} seed {seed}: {a.params}"
            assert len(a.options) == len(q.options) >= 2
            assert a.check(a.expected).correct and a.check(f"({a.expected.upper()})").correct
            right = a.options["abcdefghijklmnopqrstuvwxyz".index(a.expected)]
            assert a.check(right).correct
            others = [x for x in "abcdefghijklmnopqrstuvwxyz"[:len(a.options)] if x != a.expected]
            assert not any(a.check(x).correct for x in others)
            assert a.explanation.count("wrong:") == len(a.options) - 1
        assert q.draw(seed).statement == a.statement, "the same seed must draw the same attempt"
    if math.prod(len(v) for v in q.params.values()) > 1:
        sets = {tuple(sorted(q.draw_params(s).items())) for s in range(10)}
        assert len(sets) >= 2, f"{q.id}: 10 seeds drew one parameter set only"


# ---- answers recomputed from the primary sources' formulas --------------------------------------

def _draws(qid, n=8):
    return [get(qid).draw(s) for s in range(n)]


def test_zero_states_follow_the_zero_paper():
    """Rajbhandari et al. 2020, section 5: (2 + 2 + K) Psi with K = 12, the 2 + 2 + 12 split
    over dp from stage 1, 2 and 3."""
    for a in _draws("zero-states-per-gpu"):
        p, k, n = a.params["params_b"] * 1e9, a.params["stage"], a.params["dp"]
        by = {0: 2 + 2 + 12, 1: 2 + 2 + 12 / n, 2: 2 + (2 + 12) / n, 3: 16 / n}[k]
        assert math.isclose(a.expected, by * p / 1e9, rel_tol=1e-9), a.params


def test_ring_and_nccl_tests_formulas():
    for a in _draws("coll-ring-bytes-per-rank"):
        n, S = a.params["n"], a.params["size_gb"]
        factor = 2 * (n - 1) / n if a.params["op"] == "all_reduce" else (n - 1) / n
        assert math.isclose(a.expected, factor * S)
    for a in _draws("coll-busbw-from-measurement"):
        n = a.params["n"]
        algbw = a.params["size_mb"] * 1e6 / (a.params["time_ms"] * 1e-3) / 1e9
        factor = 2 * (n - 1) / n if a.params["op"] == "all_reduce" else (n - 1) / n
        assert math.isclose(a.expected, algbw * factor)
    a = get("coll-allreduce-seconds-seed").draw(0)
    assert math.isclose(a.expected, 2 * 7 / 8 * 14e9 / (200e9 / 8))     # 0.98 s, not 9.8


def test_ddp_numbers_in_closed_form():
    for a in _draws("ddp-sampler-samples"):
        L, R = a.params["dataset_len"], a.params["num_replicas"]
        assert a.expected == (L // R if a.params["drop_last"] else -(-L // R))
    for a in _draws("ddp-straggler-loss"):
        assert math.isclose(a.expected, 100 * (1 - a.params["fast_ms"] / a.params["slow_ms"]))
    assert math.isclose(get("ddp-straggler-seed").draw(0).expected, 100 * 40 / 140)


def test_units_and_formats_in_closed_form():
    for a in _draws("hw-gb-vs-gib"):
        assert math.isclose(a.expected * 2**30, get_gb(a.params["gpu"]) * 1e9)
    a = get("hw-network-port-gbps").draw(0)
    assert math.isclose(a.expected, {"ib-hdr": 200, "ib-ndr": 400, "eth-100g": 100,
                                     "eth-400g": 400}[a.params["link"]] / 8)
    # IEEE 754 half: (2 - 2^-10) 2^15; OCP FP8: E4M3 1.75 x 2^8 (S.1111.111 is NaN), E5M2
    # (2 - 2^-2) 2^15 (all-ones exponent is inf/NaN)
    maxima = {"fp16": (2 - 2**-10) * 2**15, "fp8-e4m3": 1.75 * 2**8, "fp8-e5m2": 1.75 * 2**15}
    for a in _draws("prec-max-value"):
        assert a.expected == maxima[a.params["fmt"]]


def get_gb(gpu):
    from labkit.hardware import GPUS
    return GPUS[gpu].memory / 1e9


# ---- checking answers ------------------------------------------------------------------------

@pytest.fixture
def zero():
    a = get("zero-7b-4gpu-seed").draw(0)
    assert a.unit == "GB"
    return a


def test_numeric_check_accepts_units_it_can_convert(zero):
    e = zero.expected
    for response in (f"{e}", f"{e} GB", f"{e}GB", f"{e:e} GB", f"{e * 1e9:.6e} B",
                     f"{e * 1e9 / 2**30:.6f} GiB", f"{e * 1e3:.3f} MB", f" ~{e} gb "):
        assert zero.check(response).correct, response
    v = zero.check(f"{e} s")
    assert not v.correct and "'s' does not convert to GB" in v.message


def test_numeric_check_explains_what_it_refuses(zero):
    e = zero.expected
    v = zero.check("12,500")
    assert not v.correct and "plain number" in v.message and v.given == "12,500"
    for blank in ("", "   ", None, "about twelve"):
        v = zero.check(blank)
        assert not v.correct and "expected a number in GB" in v.message
    v = zero.check(f"{e} parsecs")
    assert not v.correct and "'parsecs' is not understood" in v.message
    v = zero.check(e * 1.1)
    assert not v.correct and "+10%" in v.message and isinstance(v, Verdict)


def test_bandwidth_units_bits_and_bytes():
    a = get("hw-network-port-gbps").draw(1)
    gbit = a.expected * 8
    assert a.check(f"{gbit} Gb/s").correct and a.check(f"{gbit} Gbps").correct
    assert not a.check(f"{gbit} GB/s").correct
    v = a.check(f"{a.expected} gb/s")          # GB/s or Gb/s? refused, not guessed
    assert not v.correct and "not understood" in v.message


def test_choice_check_forms():
    a = get("zero2-vs-ddp-seed").draw(3)
    letter = a.expected
    for response in (letter, letter.upper(), f"({letter})", f"{letter})", f" {letter}. "):
        assert a.check(response).correct, response
    v = a.check("z")
    assert not v.correct and "one letter from a, b, c, d" in v.message
    wrong = next(x for x in "abcd" if x != letter)
    v = a.check(wrong)
    assert not v.correct and f"({letter})" in v.message


# ---- selecting and scoring -------------------------------------------------------------------

def test_select_filters_and_samples():
    ddp = select(topic="ddp")
    assert ddp and all(q.topic == "ddp" for q in ddp)
    both = select(topic=["ddp", "hardware"], difficulty=[1])
    assert {q.topic for q in both} <= {"ddp", "hardware"} and {q.difficulty for q in both} == {1}
    five = select(count=5, seed=11)
    assert len({q.id for q in five}) == 5 and [q.id for q in select(count=5, seed=11)] == \
        [q.id for q in five]
    assert [q.id for q in select(count=5, seed=12)] != [q.id for q in five]
    with pytest.raises(ValueError, match=rf"count=999 is more than the {len(ddp)} questions"):
        select(topic="ddp", count=999)
    with pytest.raises(ValueError, match="topic='ddpp' is not supported; allowed: 'memory'"):
        select(topic="ddpp")
    with pytest.raises(ValueError, match="difficulty=4 is not supported"):
        select(difficulty=4)


def _formula(q) -> str:
    return q.answer or q.verify


@pytest.mark.parametrize("topic", [None, *TOPICS])
def test_a_draw_covers_different_formulas_before_it_repeats_one(topic):
    """A 5-question --topic pp draw gave 4 questions computed by the same function (the idle
    share): no formula comes twice before every formula of the pool has come once."""
    pool = select(topic=topic)
    formulas = {_formula(q) for q in pool}
    for seed in range(20):
        for count in (5, len(formulas), len(pool)):
            drawn = select(topic=topic, count=min(count, len(pool)), seed=seed)
            assert len({q.id for q in drawn}) == len(drawn)
            first = [_formula(q) for q in drawn[:len(formulas)]]
            assert len(set(first)) == len(first), (topic, seed, count, first)


def test_pp_draws_of_five_have_five_formulas():
    for seed in range(50):
        assert len({_formula(q) for q in select(topic="pp", count=5, seed=seed)}) == 5, seed


@pytest.mark.parametrize("response", ["", "   ", "abc", "twelve", "1,5", "nan", "inf",
                                      "12 parsecs", None])
def test_a_response_that_is_no_number_is_not_an_answer(response):
    """It was scored wrong, and the quiz then showed the answer: `readable` is False, and the
    message neither scores it nor gives the expected value."""
    q = next(q for q in BANK if q.kind == "numeric" and q.unit == "GB")
    a = q.draw(0)
    v = a.check(response)
    assert not v.readable and not v.correct, v
    assert a.expected_text not in v.message and f"{a.expected:g}" not in v.message, v.message
    assert a.check(repr(a.expected)).readable and a.check(repr(2 * a.expected + 1)).readable


@pytest.mark.parametrize("response", ["", "z", "(q)", "bb", "the first one"])
def test_a_choice_that_is_no_option_is_not_an_answer(response):
    a = next(q for q in BANK if q.kind == "choice").draw(0)
    v = a.check(response)
    assert not v.readable and not v.correct and a.expected_text not in v.message
    assert a.check(a.expected).readable and a.check(a.expected).correct


def test_get_suggests_close_ids():
    with pytest.raises(ValueError, match="did you mean zero-states-per-gpu"):
        get("zero-state-per-gpu")


def test_score_tallies_by_topic_and_difficulty():
    qs = [get("zero-7b-4gpu-seed"), get("hw-gb-vs-gib"), get("hw-network-port-gbps")]
    results = []
    for q, right in zip(qs, (True, False, True)):
        a = q.draw(0)
        results.append((a, a.check(a.expected if right else a.expected * 2)))
    s = score(results)
    assert isinstance(s, Score) and (s.correct, s.total) == (2, 3)
    assert s.by_topic == {"zero-fsdp": (1, 1), "hardware": (1, 2)}
    assert s.by_difficulty == {1: (1, 2), 2: (1, 1)}
    assert math.isclose(s.percent, 200 / 3)
    assert "2/3" in str(s) and "hardware" in str(s)
    assert score([]).percent == 0.0


# ---- the schema --------------------------------------------------------------------------------

GOOD = """\
- id: my-question
  topic: hardware
  difficulty: 1
  kind: numeric
  statement: How many GiB is {gpu}?
  params: {gpu: [h100-sxm, a100-40gb]}
  answer: labkit.quiz.answers_hardware:memory_gib
  unit: GiB
  explanation: "{answer:.2f} GiB"
"""


@pytest.mark.parametrize("edit, message", [
    (("topic: hardware", "topic: networking"), "topic='networking' is not one of memory"),
    (("difficulty: 1", "difficulty: 5"), "difficulty=5 must be 1, 2 or 3"),
    (("kind: numeric", "kind: essay"), "kind='essay' must be one of numeric, choice"),
    (("id: my-question", "id: My_Question"), "id='My_Question' must be kebab-case"),
    (("  unit: GiB\n", ""), "field 'unit' is required for a numeric question"),
    (("memory_gib", "memory_gb"), "answer='labkit.quiz.answers_hardware:memory_gb' cannot be found"),
    (("labkit.quiz.answers_hardware", "os.path"), "must be 'labkit.quiz.<module>:<function>'"),
    (("How many GiB is {gpu}?", "How many GiB is {gpus}?"), "statement uses gpus, which are not params"),
    (("  unit: GiB\n", "  unit: GiB\n  tolerance: 0.2\n"), "tolerance=0.2 must be a relative tolerance from 0 to 0.05"),
    (("  unit: GiB\n", "  unit: GiB\n  colour: red\n"), "unknown field(s) colour"),
    (("[h100-sxm, a100-40gb]", "[]"), "params.gpu=[] must be a non-empty list"),
    (("  unit: GiB\n", "  unit: GiB\n  article_claim: {source: blog.md, wrong: x, why: y}\n"),
     "article_claim.source='blog.md' is not a known article; allowed: mage-7b-70b"),
    (("  unit: GiB\n", "  unit: GiB\n  seed_claim: {source: seeds/a.txt, wrong: x, why: y}\n"),
     "unknown field(s) seed_claim"),
    (("  unit: GiB\n", "  unit: GiB\n  options: []\n"), "field 'options' is not allowed in a numeric question"),
])
def test_schema_errors_name_file_id_and_field(tmp_path, edit, message):
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace(*edit))
    with pytest.raises(ValueError) as err:
        load_bank(path)
    assert str(err.value).startswith("bad.yaml: ") and message in str(err.value), str(err.value)


CHOICE = """\
- id: my-choice
  topic: precision
  difficulty: 2
  kind: choice
  statement: Which format goes where?
  options:
    - text: E4M3 forward, E5M2 backward.
      correct: true
      why: "E5M2 reaches {e5m2_max:g}."
    - text: E5M2 everywhere.
      why: coarser
  verify: labkit.quiz.answers_precision:fp8_roles
"""


def test_schema_choice_rules(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CHOICE)
    (q,) = load_bank(path)
    assert q.draw(0).check("E4M3 forward, E5M2 backward.").correct
    for edit, message in [
            (("      why: coarser\n", ""), "options[1].why is missing"),
            (("      why: coarser\n", "      why: coarser\n      correct: true\n"),
             "options has 2 correct options; exactly one is allowed"),
            (("  verify: labkit.quiz.answers_precision:fp8_roles\n", ""),
             "field 'verify' is required for a choice question")]:
        path.write_text(CHOICE.replace(*edit))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_bank(path)


def test_loader_reads_directories_and_refuses_duplicates_and_bad_yaml(tmp_path):
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD)
    with pytest.raises(ValueError, match=r"b.yaml: my-question: id='my-question' is used twice \(also in a.yaml\)"):
        load_bank(tmp_path)
    (tmp_path / "b.yaml").write_text("- id: [unclosed\n")
    with pytest.raises(ValueError, match="b.yaml: not valid YAML"):
        load_bank(tmp_path / "b.yaml")
    with pytest.raises(ValueError, match="is neither a YAML file nor a directory"):
        load_bank(tmp_path / "missing.yaml")
    (tmp_path / "b.yaml").write_text("question: not a list\n")
    with pytest.raises(ValueError, match="b.yaml: must be a YAML list of questions"):
        load_bank(tmp_path / "b.yaml")


def test_render_errors_name_the_question(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(GOOD.replace('"{answer:.2f} GiB"', '"{answr:.2f} GiB"'))
    (q,) = load_bank(path)
    with pytest.raises(ValueError, match=r"r.yaml: my-question: cannot render .*KeyError 'answr'"):
        q.draw(0)


def test_a_unit_on_a_unitless_answer_is_refused_not_scored():
    """'12 parsecs' to a question with no unit is a misread answer, not 12 (a unitless
    answer used to accept any trailing word)."""
    from labkit.quiz.bank import load_bank

    unitless = [q for q in load_bank() if q.kind == "numeric" and not q.unit]
    assert unitless, "the bank has a unitless numeric question to check this on"
    a = unitless[0].draw(0)
    v = a.check(f"{a.expected} parsecs")
    assert not v.correct and not v.readable and "has no unit" in v.message
    assert a.check(str(a.expected)).correct
