"""The quiz widget, driven as a learner would (set .value, .click()) with no kernel, on the real
bank: right answers (computed from each attempt's expected value) score 100 %, wrong ones 0 %,
a mix gives the per-topic counts tallied here; feedback shows the expected answer, the worked
explanation and a popular article's wrong claim (cited by title and author); Enter submits; an
answer that is no number is asked again, not scored; timed mode with a fake clock; bad settings
are a message, never a traceback."""
from __future__ import annotations

import html
import re

import pytest

from labkit.quiz import TOPICS, load_bank, select
from labkit.widgets.quiz import LEVELS, MAX_SECONDS, QuizWidget

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def right(a) -> str:
    """A right response: the expected number (full precision) or the correct letter."""
    return a.expected if a.kind == "choice" else repr(a.expected)


def wrong(a) -> str:
    """A wrong response: another option, or a number ten times the answer's size away (beyond
    any relative tolerance up to 5 % and any absolute one)."""
    if a.kind == "choice":
        return next(x for x in LETTERS[:len(a.options)] if x != a.expected)
    q = a.question
    return repr(a.expected + 10 * max(abs(a.expected), q.abs_tolerance, 1.0))


def respond(quiz: QuizWidget, text: str) -> None:
    """Pick an option, or type a number and press Enter (the box sends its value: submitted)."""
    a = quiz.session[quiz.index]
    if a.kind == "choice":
        quiz.choice.value = text
    else:
        quiz.answer.value = text


def play(quiz: QuizWidget, answer) -> list[str]:
    """Start, answer every question with answer(index, attempt), Next after each; the feedback
    shown after each answer."""
    quiz.start.click()
    assert quiz.message.value == "", quiz.message.value
    shown = []
    for i, a in enumerate(quiz.session):
        assert quiz.index == i and quiz.session[i] is a
        respond(quiz, answer(i, a))
        quiz.submit.click()
        shown.append(quiz.feedback.value)
        quiz.next.click()
    return shown


def text(value: str) -> str:
    """HTML as it reads: tags dropped, entities decoded, whitespace squeezed."""
    return " ".join(html.unescape(re.sub(r"<br>", "\n", re.sub(r"<(?!br>)[^>]+>", " ", value)))
                    .split())


def squeeze(s: str) -> str:
    return " ".join(s.split())


def test_all_right_scores_100_percent():
    quiz = QuizWidget(count=10, seed=3)
    play(quiz, lambda i, a: right(a))
    assert len(quiz.attempts) == 10 and all(v.correct for _, v in quiz.attempts)
    assert quiz.result.correct == 10 and quiz.result.percent == 100
    assert "Score: 10 of 10 (100 %)" in text(quiz.score_html.value)
    assert quiz.state == "done" and quiz.next.layout.display == "none"


def test_all_wrong_scores_0_percent():
    quiz = QuizWidget(count=10, seed=4)
    play(quiz, lambda i, a: wrong(a))
    assert [v.correct for _, v in quiz.attempts] == [False] * 10
    assert "Score: 0 of 10 (0 %)" in text(quiz.score_html.value)


def test_mixed_answers_give_the_per_topic_counts():
    n = 12
    quiz = QuizWidget(count=n, seed=11)
    play(quiz, lambda i, a: right(a) if i % 3 else wrong(a))
    want: dict[str, list[int]] = {}
    for i, a in enumerate(quiz.session):
        c, t = want.setdefault(a.question.topic, [0, 0])
        want[a.question.topic] = [c + (i % 3 != 0), t + 1]
    assert {k: list(v) for k, v in quiz.result.by_topic.items()} == want
    right_count = sum(1 for i in range(n) if i % 3)
    shown = text(quiz.score_html.value)
    assert f"Score: {right_count} of {n}" in shown
    for topic, (c, t) in want.items():
        assert f"{topic} {c} / {t}" in shown, (topic, shown)
    levels: dict[int, list[int]] = {}
    for i, a in enumerate(quiz.session):
        c, t = levels.setdefault(a.question.difficulty, [0, 0])
        levels[a.question.difficulty] = [c + (i % 3 != 0), t + 1]
    assert {k: list(v) for k, v in quiz.result.by_difficulty.items()} == levels
    for level, (c, t) in levels.items():
        assert f"{LEVELS[level]} {c} / {t}" in shown, (level, shown)


def test_a_seed_repeats_the_quiz_and_seeds_differ():
    a, b, c = QuizWidget(count=8, seed=5), QuizWidget(count=8, seed=5), QuizWidget(count=8, seed=6)
    for quiz in (a, b, c):
        quiz.start.click()
    ids = [[x.question.id for x in q.session] for q in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert [x.statement for x in a.session] == [x.statement for x in b.session]
    # the session is the bank's: select with the seed, each question drawn with it
    assert ids[0] == [q.id for q in select(count=8, seed=5)]
    assert [x.statement for x in a.session] == [q.draw(seed=5).statement
                                                for q in select(count=8, seed=5)]
    free = QuizWidget(count=3)
    free.start.click()
    assert isinstance(free.seed, int) and free.session


def test_feedback_shows_the_expected_answer_explanation_and_article_claim():
    with_claim = [q for q in load_bank() if q.article_claim]
    assert with_claim, "the bank has questions with a popular article's wrong claim"
    topic = with_claim[0].topic
    available = len(select(topic=topic))
    quiz = QuizWidget(topic=topic, count=available, seed=0)
    shown = play(quiz, lambda i, a: wrong(a))
    claims = 0
    for (a, v), fb in zip(quiz.attempts, shown):
        got = text(fb)
        assert not v.correct and "Wrong" in got
        assert squeeze(a.expected_text) in got
        assert squeeze(a.explanation) in got
        if a.article_claim:
            claims += 1
            assert f"A popular article, {squeeze(a.article_claim['source'])}, says" in got
            for key in ("source", "wrong", "why"):
                assert squeeze(a.article_claim[key]) in got
        assert "seeds/" not in got and "seed article" not in got.lower()
    assert claims >= 1


def test_choice_questions_through_the_radio_buttons():
    choice = [q for q in load_bank() if q.kind == "choice"]
    assert choice
    topic = choice[0].topic
    quiz = QuizWidget(topic=topic, count=len(select(topic=topic)), seed=2)
    quiz.start.click()
    seen = 0
    for a in quiz.session:
        if a.kind == "choice":
            seen += 1
            assert quiz.choice.layout.display == "" and quiz.numeric_row.layout.display == "none"
            assert [v for _, v in quiz.choice.options] == list(LETTERS[:len(a.options)])
            shown = text(quiz.question_html.value)           # the options, in the shown order
            at = [shown.index(squeeze(t)) for t in a.options]
            assert at == sorted(at), (a.options, shown)
            quiz.choice.value = a.expected
        else:
            assert quiz.choice.layout.display == "none" and quiz.numeric_row.layout.display == ""
            assert quiz.unit.value == a.unit
            quiz.answer.value = right(a)
        quiz.submit.click()
        quiz.next.click()
    assert seen >= 1 and quiz.result.percent == 100


def test_nothing_given_is_a_message_not_an_answer():
    quiz = QuizWidget(count=2, seed=1)
    quiz.start.click()
    quiz.submit.click()
    assert quiz.attempts == [] and "No answer yet" in text(quiz.feedback.value)
    quiz.next.click()                                   # not answered: Next does nothing
    assert quiz.index == 0
    respond(quiz, right(quiz.session[0]))
    quiz.submit.click()
    quiz.submit.click()                                 # a second Submit is not a second answer
    assert len(quiz.attempts) == 1 and quiz.attempts[0][1].correct


def numeric_quiz(seed=1) -> QuizWidget:
    """A started quiz whose first question is numeric."""
    for s in range(seed, seed + 50):
        quiz = QuizWidget(count=3, seed=s)
        quiz.start.click()
        if quiz.session[0].kind == "numeric":
            return quiz
    raise AssertionError("no numeric first question in 50 seeds")


def test_enter_in_the_answer_box_submits():
    """The box sends its value on Enter (continuous_update=False); that value is the answer,
    with no click on Submit."""
    quiz = numeric_quiz()
    assert quiz.answer.continuous_update is False
    a = quiz.session[0]
    quiz.answer.value = right(a)                        # what Enter sends
    assert len(quiz.attempts) == 1 and quiz.attempts[0][1].correct
    assert quiz.state == "answered" and "Right" in text(quiz.feedback.value)
    quiz.submit.click()                                 # Submit after Enter: not a 2nd answer
    assert len(quiz.attempts) == 1
    quiz.next.click()                                   # the box is cleared: not an answer
    assert len(quiz.attempts) == 1 and quiz.answer.value == "" and quiz.state == "asking"


@pytest.mark.parametrize("junk", ["abc", "twelve", "1,5", "nan", "12 parsecs", "   "])
def test_an_answer_that_is_no_number_is_asked_again_not_scored(junk):
    """It was scored Wrong and revealed the answer: now a message, the question stays open, and
    the answer appears only once one is given."""
    quiz = numeric_quiz()
    a = quiz.session[0]
    quiz.answer.value = junk                            # Enter
    quiz.submit.click()                                 # and Submit: the same
    shown = text(quiz.feedback.value)
    assert quiz.attempts == [] and quiz.state == "asking", shown
    if junk.strip():
        assert "Not an answer yet" in shown and "Try again" in shown
    else:
        assert "No answer yet" in shown
    assert squeeze(a.expected_text) not in shown and "Wrong" not in shown
    assert quiz.next.layout.display == "none"
    quiz.answer.value = wrong(a)
    assert len(quiz.attempts) == 1 and not quiz.attempts[0][1].correct
    assert squeeze(a.expected_text) in text(quiz.feedback.value)


@pytest.mark.parametrize("count", ["0", "-3", "abc", "2.5", "", "99999", "1e3"])
def test_bad_count_is_a_message(count):
    available = len(load_bank())
    quiz = QuizWidget(count=count)
    quiz.start.click()
    shown = text(quiz.message.value)
    assert "Cannot compute" in shown and "questions=" in shown
    if count.lstrip("-").isdigit():
        assert f"allowed: 1 to {available}" in shown
    assert quiz.session == [] and quiz.state == "setup"
    assert quiz.question_html.layout.display == "none"


def test_count_beyond_a_topic_names_the_topic_range():
    topic = next(t for t in TOPICS if select(topic=t))     # the first topic with questions
    available = len(select(topic=topic, difficulty=None))
    quiz = QuizWidget(topic=topic, count=available + 1)
    assert quiz.available.value == f"of {available}"
    quiz.start.click()
    assert f"allowed: 1 to {available} (the questions in the bank with topic {topic})" in text(
        quiz.message.value)
    quiz.count.value = str(available)                   # fixed: the session starts
    quiz.start.click()
    assert quiz.message.value == "" and len(quiz.session) == available
    quiz.topic.value = "all"                            # the count offered follows the topic
    assert quiz.available.value == f"of {len(load_bank())}"


def test_bad_seconds_and_bad_starting_values():
    quiz = QuizWidget(count=2, timed=True, seconds_per_question=0)
    quiz.start.click()
    assert f"allowed: 1 to {MAX_SECONDS} seconds" in text(quiz.message.value)
    assert quiz.session == []
    with pytest.raises(ValueError, match="topic='tensor' is not offered; allowed: 'all'"):
        QuizWidget(topic="tensor")
    with pytest.raises(ValueError, match="difficulty=4 is not offered"):
        QuizWidget(difficulty=4)


def test_timed_mode_with_a_fake_clock():
    now = [100.0]
    quiz = QuizWidget(count=3, seed=8, timed=True, seconds_per_question=60,
                      clock=lambda: now[0])
    assert quiz.seconds.layout.display == ""
    quiz.start.click()
    assert "60 s to answer" in text(quiz.question_html.value)
    a = quiz.session[0]
    now[0] += 61.0                                      # one second late
    respond(quiz, right(a))
    quiz.submit.click()
    v = quiz.attempts[0][1]
    assert not v.correct and "time up" in v.message and "61.0 s" in v.message
    assert "time up" in text(quiz.feedback.value)
    now[0] += 500.0                                     # time reading the feedback does
    quiz.next.click()                                   # not count: the clock restarts
    now[0] += 60.0                                      # when a question shows; exactly
    respond(quiz, right(quiz.session[1]))               # the time allowed: in time
    quiz.submit.click()
    assert quiz.attempts[1][1].correct
    assert "answered in 60.0 s of 60 s" in text(quiz.feedback.value)
    quiz.next.click()
    respond(quiz, right(quiz.session[2]))
    quiz.submit.click()
    assert quiz.result.correct == 2 and quiz.result.total == 3
    quiz.timed.value = False                            # untimed: no limit, field hidden
    assert quiz.seconds.layout.display == "none"
    quiz.start.click()
    now[0] += 10**6
    respond(quiz, right(quiz.session[0]))
    quiz.submit.click()
    assert quiz.attempts[0][1].correct


def test_start_again_resets_the_session():
    quiz = QuizWidget(count=2, seed=9)
    play(quiz, lambda i, a: right(a))
    assert quiz.score_html.value
    quiz.count.value = "3"
    quiz.start.click()
    assert quiz.attempts == [] and quiz.result is None and quiz.score_html.value == ""
    assert len(quiz.session) == 3 and quiz.index == 0 and quiz.feedback.value == ""
    assert "Question 1 of 3" in text(quiz.question_html.value)
