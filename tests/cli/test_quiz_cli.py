"""`labkit quiz` in the terminal, non-interactively: answers piped in, the score printed equals
the right answers fed (computed here by drawing the same questions through the bank API with
the same seed); the end of the input leaves the rest unanswered and still prints the score; bad
arguments exit 2 with a message naming what is allowed; --list counts the bank."""
from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys

import pytest

from labkit.cli import COMMANDS
from labkit.cli import quiz as cli
from labkit.quiz import TOPICS, load_bank, select

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def session(count, seed, topic=None, difficulty=None):
    """The questions `labkit quiz --count N --seed S` asks, drawn here through the bank API."""
    return [q.draw(seed=seed) for q in select(topic=topic, difficulty=difficulty, count=count,
                                              seed=seed)]


def right(a) -> str:
    return a.expected if a.kind == "choice" else f"{a.expected!r} {a.unit}".strip()


def wrong(a) -> str:
    if a.kind == "choice":
        return next(x for x in LETTERS[:len(a.options)] if x != a.expected)
    return repr(a.expected + 10 * max(abs(a.expected), a.question.abs_tolerance, 1.0))


def parse(argv):
    parser = argparse.ArgumentParser(prog="labkit quiz")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def score_of(out: str) -> tuple[int, int]:
    found = re.findall(r"^Score: (\d+)/(\d+) \(", out, flags=re.M)
    assert len(found) == 1, out[-2000:]
    return tuple(map(int, found[0]))


def test_ten_questions_piped_into_a_subprocess():
    seed, pattern = 20, [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    asked = session(10, seed)
    answers = [right(a) if ok else wrong(a) for a, ok in zip(asked, pattern)]
    r = subprocess.run([sys.executable, "-m", "labkit.cli.quiz", "--count", "10", "--seed",
                        str(seed)], input="\n".join(answers) + "\n", capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert score_of(r.stdout) == (sum(pattern), 10)
    for number, a in enumerate(asked, 1):                  # asked in that order, as drawn
        assert f"Question {number} of 10 · {a.question.topic}" in r.stdout
        assert a.statement in r.stdout
    assert r.stdout.count("[right]") == sum(pattern) and r.stdout.count("[wrong]") == 4
    by_topic: dict[str, list[int]] = {}
    for a, ok in zip(asked, pattern):
        c, t = by_topic.setdefault(a.question.topic, [0, 0])
        by_topic[a.question.topic] = [c + ok, t + 1]
    for topic, (c, t) in by_topic.items():
        assert re.search(rf"^  {re.escape(topic)} +{c}/{t}$", r.stdout, flags=re.M), topic


def test_run_with_a_patched_stdin():
    seed = 31
    asked = session(10, seed)
    answers = [right(a) for a in asked[:7]] + [wrong(a) for a in asked[7:]]
    out = io.StringIO()
    assert cli.run(parse(["--seed", str(seed)]), stdin=io.StringIO("\n".join(answers) + "\n"),
                   out=out) == 0
    shown = out.getvalue()
    assert score_of(shown) == (7, 10)
    for a in asked:                                         # each verdict with its explanation
        assert a.expected_text in shown and a.explanation in shown
    for a in asked:
        if a.article_claim:
            assert a.article_claim["wrong"] in shown and a.article_claim["source"] in shown
    assert "seeds/" not in shown and "seed article" not in shown.lower()


def test_popular_articles_are_cited_by_title_and_author():
    """It printed 'A seed article (seeds/003_71cd8334a14642c0.txt) says ...'."""
    from labkit.quiz.articles import ARTICLES

    with_claim = [q for q in load_bank() if q.article_claim]
    topic = with_claim[0].topic
    n = len(select(topic=topic))
    feed = "".join(wrong(a) + "\n" for a in session(n, 0, topic=topic))
    out = io.StringIO()
    assert cli.run(parse(["--topic", topic, "--count", str(n), "--seed", "0"]),
                   stdin=io.StringIO(feed), out=out) == 0
    shown = out.getvalue()
    cited = [c for c in ARTICLES.values() if f"A popular article, {c}, says" in shown]
    assert cited, shown[-3000:]
    assert "seeds/" not in shown and "seed article" not in shown.lower()


@pytest.mark.parametrize("junk", ["", "   ", "abc", "twelve", "1,5"])
def test_an_empty_or_non_number_line_is_asked_again_not_scored(junk):
    """An accidental Enter (or a word) was scored wrong and the answer shown: now the question
    is asked again, and the answer appears only after a real answer."""
    seed = 8
    first = session(1, seed)[0]
    answer = right(first)
    out = io.StringIO()
    feed = f"{junk}\n{junk}\n{answer}\n"
    assert cli.run(parse(["--count", "1", "--seed", str(seed)]), stdin=io.StringIO(feed),
                   out=out) == 0
    shown = out.getvalue()
    assert score_of(shown) == (1, 1) and "[wrong]" not in shown
    assert shown.count("Not an answer yet") == 2
    before = shown.split("[right]")[0]
    assert f"Answer: {first.expected_text}" not in before
    assert shown.count("answer> ") == 3                     # asked again after each


def test_junk_then_the_end_of_input_reveals_nothing():
    a = session(1, 3)[0]
    out = io.StringIO()
    assert cli.run(parse(["--count", "1", "--seed", "3"]), stdin=io.StringIO("\nxyz\n"),
                   out=out) == 0
    shown = out.getvalue()
    assert score_of(shown) == (0, 1) and "end of input" in shown
    assert "Answer:" not in shown and a.explanation not in shown


def test_labkit_quiz_command(monkeypatch, capsys):
    assert "quiz" in COMMANDS
    from labkit.cli import main

    asked = session(10, 5)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(right(a) + "\n" for a in asked)))
    assert main(["quiz", "--count", "10", "--seed", "5"]) == 0
    assert score_of(capsys.readouterr().out) == (10, 10)


def test_end_of_input_leaves_the_rest_unanswered():
    asked = session(5, 12)
    out = io.StringIO()
    feed = "".join(right(a) + "\n" for a in asked[:3])      # three answers, then EOF
    assert cli.run(parse(["--count", "5", "--seed", "12"]), stdin=io.StringIO(feed), out=out) == 0
    shown = out.getvalue()
    assert score_of(shown) == (3, 5)
    assert "end of input" in shown and "Question 5 of 5" not in shown
    out = io.StringIO()
    assert cli.run(parse(["--count", "4", "--seed", "1"]), stdin=io.StringIO(""), out=out) == 0
    assert score_of(out.getvalue()) == (0, 4)


def test_timed_answers_with_a_fake_clock():
    asked = session(3, 4)
    ticks = iter([0.0, 5.0, 10.0, 71.0, 80.0, 139.0])      # shown/answered: 5 s, 61 s, 59 s
    out = io.StringIO()
    feed = "".join(right(a) + "\n" for a in asked)
    assert cli.run(parse(["--count", "3", "--seed", "4", "--timed", "60"]),
                   stdin=io.StringIO(feed), out=out, clock=lambda: next(ticks)) == 0
    shown = out.getvalue()
    assert score_of(shown) == (2, 3)
    assert "time up: answered after 61.0 s; 60 s allowed" in shown
    assert "60 s to answer" in shown


@pytest.mark.parametrize("argv, message", [
    (["--count", "0"], "--count=0 is out of range; allowed: a whole number from 1 to {n}"),
    (["--count", "ten"], "--count='ten' is not a whole number; allowed: a whole number from 1"),
    (["--count", "100000"], "allowed: a whole number from 1 to {n}"),
    (["--difficulty", "4"], "--difficulty=4 is out of range; allowed: a whole number from 1 to 3"),
    (["--topic", "tensor"], "--topic='tensor' is not a topic; allowed: " + ", ".join(TOPICS)),
    (["--timed", "0"], "--timed=0 is out of range; allowed: a whole number from 1 to 3,600"),
    (["--seed", "x"], "--seed='x' is not a whole number"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    stdin = io.StringIO("1\n" * 20)
    assert cli.run(parse(argv), stdin=stdin, out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert message.format(n=len(load_bank())) in err, err


def test_count_beyond_a_topic_and_a_subprocess_error():
    topic = next(t for t in TOPICS if select(topic=t))     # the first topic with questions
    n = len(select(topic=topic))
    r = subprocess.run([sys.executable, "-m", "labkit.cli.quiz", "--topic", topic, "--count",
                        str(n + 1)], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--count={n + 1} is out of range; allowed: a whole number from 1 to {n}" in r.stderr


def test_list_counts_the_bank():
    bank = load_bank()
    out = io.StringIO()
    assert cli.run(parse(["--list"]), out=out) == 0
    rows = {line.split()[0]: list(map(int, line.split()[1:]))
            for line in out.getvalue().splitlines()[1:]}
    for topic in TOPICS:
        want = [sum(q.topic == topic and q.difficulty == d for q in bank) for d in (1, 2, 3)]
        if sum(want):
            assert rows[topic] == want + [sum(want)], topic
        else:
            assert topic not in rows
    assert rows["total"][-1] == len(bank)
    assert rows["total"][:3] == [sum(q.difficulty == d for q in bank) for d in (1, 2, 3)]
