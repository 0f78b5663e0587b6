"""The quiz: questions from the interview bank (`labkit.quiz`), one at a time, each answer checked
by the bank, with the worked explanation; at the end the score by topic and difficulty.

    >>> from labkit.widgets.quiz import QuizWidget
    >>> quiz = QuizWidget(topic="pp", count=3, seed=1)
    >>> quiz.start.click()                       # the session: quiz.session (Attempts)
    >>> quiz.answer.value = "12.5"               # numeric, as Enter sends it: submitted
    >>> quiz.choice.value = "b"; quiz.submit.click()   # choice: pick, then Submit
    >>> quiz.feedback.value                      # verdict, expected answer, explanation
    >>> quiz.next.click()                        # ... after the last: quiz.score_html.value
"""
from __future__ import annotations

import html
import random
import time

import ipywidgets as widgets

from labkit.quiz import TOPICS, Verdict, score, select
from labkit.widgets import Calculator, error_html, int_field, pick, row, table_html, whole_number

ALL = "all"
MAX_SECONDS = 3600          # time allowed per question in timed mode: 1 s to an hour
SEED_RANGE = 2**31          # a session's seed when none is given: random below this
LEVELS = {1: "1 easy", 2: "2 medium", 3: "3 hard"}


def esc(text) -> str:
    """Text for HTML, line breaks kept (statements and explanations are plain text)."""
    return html.escape(str(text)).replace("\n", "<br>")


def draw_session(topic=None, difficulty=None, count=None, seed=None) -> list:
    """The attempts of one session: `count` questions picked by the bank (seeded), each drawn
    with the same seed (a draw is deterministic for (question id, seed)). The CLI does the same,
    so a seed gives the same quiz in the notebook and in the terminal."""
    return [q.draw(seed=seed) for q in select(topic=topic, difficulty=difficulty, count=count,
                                              seed=seed)]


def article_claim_text(attempt) -> str | None:
    """The wrong claim of a popular article (cited by title and author) that this question
    corrects, or None."""
    claim = attempt.article_claim
    if not claim:
        return None
    return (f"A popular article, {claim['source']}, says {claim['wrong']}; that is wrong: "
            f"{claim['why']}")


def time_up(attempt, response: str, elapsed: float, allowed: float) -> Verdict:
    """The verdict for an answer given after the time allowed: wrong, whatever it says."""
    return Verdict(correct=False, expected=attempt.expected, given=response,
                   message=f"time up: answered after {elapsed:,.1f} s; {allowed:,g} s allowed")


def score_table(s) -> tuple[list, list]:
    """(rows by topic, rows by difficulty) of a Score, as [name, 'c / t', 'p %'] cells."""
    def rows(by, name):
        return [[name(k), f"{c} / {t}", f"{100 * c / t:.0f} %"] for k, (c, t) in by.items()]
    return rows(s.by_topic, str), rows(s.by_difficulty, lambda d: LEVELS.get(d, str(d)))


class QuizWidget(Calculator):
    """Controls (`controls`, also attributes): topic ("all" or one of TOPICS), difficulty
    ("all", 1, 2, 3), count (typed, 1 to the questions available), timed (Checkbox), seconds
    (per question, timed mode), start (Button). During a session: question_html, answer (Text,
    numeric questions; the unit is shown beside it), choice (RadioButtons, value the option's
    letter), submit, feedback, next; at the end score_html. `message` shows bad settings.
    `session` holds the session's Attempts, `attempts` the (Attempt, Verdict) answered so far,
    `result` the Score at the end (else None), `seed` the session's seed.

    Each answer is checked by the bank (the expected value computed by labkit for the numbers
    drawn), with the worked explanation and, where a popular article got the question wrong,
    its wrong figure; the score has a breakdown by topic and difficulty (`labkit.quiz.score`).
    Enter in the answer box submits (as Submit does); an answer that is no number (or no
    option) gets a message and the question stays open: it is not scored and the answer is not
    shown.

    Timed mode: an answer submitted more than `seconds_per_question` after its question was
    shown counts as wrong ("time up"). Time is read from `clock` when the question is shown and
    when the answer is submitted (no timers or threads: a test passes a fake clock).

    A thin view like the calculators: the bank draws and checks, results sit in widget traits
    (HTML.value), bad input is a message, never a traceback."""

    def __init__(self, topic=None, difficulty=None, count=10, timed=False,
                 seconds_per_question=60, seed=None, clock=time.monotonic):
        self.topic = pick("topic", [ALL, *TOPICS], ALL)
        self.difficulty = pick("difficulty", [("all", ALL)] + [(v, k) for k, v in LEVELS.items()],
                               ALL)
        self.count = int_field("questions", count, width="200px")
        self.timed = widgets.Checkbox(value=False, description="timed", indent=False,
                                      layout=widgets.Layout(width="80px"))
        self.seconds = int_field("seconds each", seconds_per_question, width="200px")
        self.start = widgets.Button(description="Start", button_style="primary")
        self.controls = {"topic": self.topic, "difficulty": self.difficulty,
                         "count": self.count, "timed": self.timed, "seconds": self.seconds}
        self._set_initial({"topic": ALL if topic is None else topic,
                           "difficulty": ALL if difficulty is None else difficulty,
                           "timed": timed})
        self.fixed_seed, self.clock = seed, clock
        self.message = widgets.HTML()
        self.question_html = widgets.HTML()
        # Enter submits: the box sends its value on Enter (or when it loses focus, as a click
        # on Submit makes it), and a new value while a question is open is an answer
        # (ipywidgets 8's replacement for the deprecated Text.on_submit)
        self.answer = widgets.Text(description="answer", placeholder="a number, then Enter",
                                   continuous_update=False,
                                   layout=widgets.Layout(width="300px"))
        self.unit = widgets.Label()
        # lettered buttons; the options' text is in question_html, where long lines wrap (a
        # radio label is one line high in JupyterLab)
        self.choice = widgets.RadioButtons(options=[], value=None, orientation="horizontal",
                                           description="answer", layout=widgets.Layout(
                                               width="auto"))
        self.available = widgets.Label()
        self.submit = widgets.Button(description="Submit")
        self.next = widgets.Button(description="Next")
        self.feedback = widgets.HTML()
        self.score_html = widgets.HTML()
        self.session: list = []
        self.attempts: list = []
        self.result = None
        self.seed = seed
        self.index = 0
        self.shown_at = 0.0
        self.allowed: float | None = None
        self.state = "setup"           # setup -> asking <-> answered -> done
        self.numeric_row = row([self.answer, self.unit])
        self.widget = widgets.VBox([
            row([self.topic, self.difficulty, self.count, self.available, self.timed,
                 self.seconds, self.start]),
            self.message, self.question_html, self.numeric_row, self.choice,
            row([self.submit, self.next]), self.feedback, self.score_html])
        for name, w in {**self.controls, "start": self.start, "answer": self.answer,
                        "choice": self.choice, "submit": self.submit, "next": self.next}.items():
            w.add_class("labkit-control")
            w.add_class(f"labkit-control-{name}")
        for w in (self.timed, self.topic, self.difficulty):
            w.observe(self._on_change, names="value")
        self.answer.observe(self._on_typed, names="value")
        self.start.on_click(lambda _: self.begin())
        self.submit.on_click(lambda _: self.answer_question())
        self.next.on_click(lambda _: self.advance())
        self.update()
        self._show()

    # ---- settings ---------------------------------------------------------------------------
    def update(self) -> None:
        """Show the seconds field only in timed mode and how many questions the topic and
        difficulty offer (the settings are read at Start)."""
        self.seconds.layout.display = "" if self.timed.value else "none"
        topic = None if self.topic.value == ALL else self.topic.value
        difficulty = None if self.difficulty.value == ALL else self.difficulty.value
        self.available.value = f"of {len(select(topic=topic, difficulty=difficulty))}"

    def settings(self) -> dict:
        """The session's settings from the controls: topic, difficulty, count, allowed seconds
        (None untimed); ValueError naming the field and its allowed range."""
        topic = None if self.topic.value == ALL else self.topic.value
        difficulty = None if self.difficulty.value == ALL else self.difficulty.value
        available = len(select(topic=topic, difficulty=difficulty))
        where = " and ".join(x for x in (f"topic {topic}" if topic else "",
                                         f"difficulty {difficulty}" if difficulty else "") if x)
        if available == 0:
            raise ValueError(f"no question in the bank has {where}; pick another topic or "
                             "difficulty")
        count = whole_number("questions", self.count.value)
        if not 1 <= count <= available:
            raise ValueError(f"questions={count} is out of range; allowed: 1 to {available} "
                             f"(the questions in the bank" + (f" with {where})" if where else ")"))
        allowed = None
        if self.timed.value:
            allowed = whole_number("seconds each", self.seconds.value)
            if not 1 <= allowed <= MAX_SECONDS:
                raise ValueError(f"seconds each={allowed} is out of range; allowed: 1 to "
                                 f"{MAX_SECONDS} seconds per question")
        return dict(topic=topic, difficulty=difficulty, count=count, allowed=allowed)

    # ---- the session ------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a session with the current settings (a bad setting: a message, no session)."""
        try:
            s = self.settings()
        except ValueError as exc:
            self.message.value = error_html(exc)
            self.state, self.session, self.attempts, self.result = "setup", [], [], None
            self._show()
            return
        self.message.value = ""
        self.seed = (self.fixed_seed if self.fixed_seed is not None
                     else random.randrange(SEED_RANGE))
        self.session = draw_session(s["topic"], s["difficulty"], s["count"], self.seed)
        self.allowed, self.attempts, self.result, self.index = s["allowed"], [], None, 0
        self._ask()

    def _ask(self) -> None:
        a = self.session[self.index]
        self.state = "asking"
        self.answer.value = ""
        self.unit.value = a.unit or ""
        letters = [chr(ord("a") + i) for i in range(len(a.options))]
        self.choice.options = [(f"({x})", x) for x in letters]
        self.choice.value = None
        self.feedback.value = self.score_html.value = ""
        timed = (f" · {self.allowed:g} s to answer" if self.allowed is not None else "")
        q = a.question
        self.question_html.value = (
            f'<div class="labkit-quiz-question"><b>Question {self.index + 1} of '
            f"{len(self.session)}</b> · {esc(q.topic)} · difficulty {q.difficulty}{timed}"
            f"<p>{esc(a.statement)}</p>"
            + (f"<p><i>Answer in {esc(a.unit)}.</i></p>" if a.kind != "choice" and a.unit
               else "")
            + ("<ol type='a'>" + "".join(f"<li>{esc(t)}</li>" for t in a.options) + "</ol>"
               if a.kind == "choice" else "") + "</div>")
        self._show()
        self.shown_at = self.clock()

    def response(self) -> str:
        """What the learner gave for the current question: the typed text or the chosen
        letter ('' when nothing)."""
        if self.session[self.index].kind == "choice":
            return self.choice.value or ""
        return self.answer.value.strip()

    def answer_question(self) -> None:
        """Check the current answer (Submit). Nothing typed or chosen: a message, not an
        answer; in timed mode an answer after the time allowed is wrong."""
        if self.state != "asking":
            return
        a, given = self.session[self.index], self.response()
        if not given:
            what = "choose an option" if a.kind == "choice" else (
                "type a number" + (f" (in {a.unit})" if a.unit else ""))
            self.feedback.value = (f'<div class="labkit-error" style="color:#b00020">'
                                   f"No answer yet: {esc(what)}, then Submit.</div>")
            return
        elapsed = self.clock() - self.shown_at
        if self.allowed is not None and elapsed > self.allowed:
            verdict = time_up(a, given, elapsed, self.allowed)
        else:
            verdict = a.check(given)
        if not verdict.readable:                  # no answer at all: say why, ask again
            self.feedback.value = (f'<div class="labkit-error" style="color:#b00020">'
                                   f"Not an answer yet: {esc(verdict.message)}. Try again."
                                   "</div>")
            return
        self.attempts.append((a, verdict))
        self.feedback.value = self._feedback(a, verdict, elapsed)
        if len(self.attempts) == len(self.session):
            self.state = "done"
            self.result = score(self.attempts)
            self.score_html.value = self._score()
        else:
            self.state = "answered"
        self._show()

    def _on_typed(self, change) -> None:
        """Enter in the answer box: submit what it holds (clearing it for the next question,
        or an empty box, submits nothing)."""
        if self.state == "asking" and str(change["new"]).strip():
            self.answer_question()

    def advance(self) -> None:
        """The next question (Next), once the current one is answered."""
        if self.state == "answered":
            self.index += 1
            self._ask()

    # ---- what is shown ----------------------------------------------------------------------
    def _show(self) -> None:
        """Show the controls that fit the state: the answer box or the options while asking,
        Next once answered (not after the last question)."""
        asking = self.state in ("asking", "answered")
        kind = self.session[self.index].kind if asking else None
        self.numeric_row.layout.display = "" if asking and kind != "choice" else "none"
        self.choice.layout.display = "" if asking and kind == "choice" else "none"
        self.answer.disabled = self.choice.disabled = self.state != "asking"
        self.submit.disabled = self.state != "asking"
        self.submit.layout.display = "" if asking else "none"
        self.next.layout.display = "" if self.state == "answered" else "none"
        self.question_html.layout.display = "" if self.state != "setup" else "none"

    def _feedback(self, a, v, elapsed: float) -> str:
        mark, colour = ("right", "#1b5e20") if v.correct else ("wrong", "#b00020")
        parts = [f'<div class="labkit-quiz-{mark}" style="color:{colour}"><b>{mark.title()}'
                 f"</b> · {esc(v.message)}</div>",
                 f"<p>Answer: <b>{esc(a.expected_text)}</b>"
                 + (f" · answered in {elapsed:,.1f} s of {self.allowed:g} s"
                    if self.allowed is not None and elapsed <= self.allowed else "") + "</p>",
                 f"<p>{esc(a.explanation)}</p>"]
        claim = article_claim_text(a)
        if claim:
            parts.append(f'<p class="labkit-quiz-article"><i>{esc(claim)}</i></p>')
        return '<div class="labkit-quiz-feedback">' + "".join(parts) + "</div>"

    def _score(self) -> str:
        s = self.result
        topics, levels = score_table(s)
        return (f'<div class="labkit-quiz-score"><b>Score: {s.correct} of {s.total} '
                f"({s.percent:.0f} %)</b> · seed {self.seed}"
                + table_html(topics, ["topic", "correct", "share"])
                + table_html(levels, ["difficulty", "correct", "share"]) + "</div>")
