"""The question bank: load and validate the YAML questions, draw an attempt, check an answer.

    bank = load_bank(); q = get("zero-states-per-gpu"); a = q.draw(seed=7)
    a.statement; a.check("12.5 GB").correct; score([(a, v), ...]).percent

A question is data (labkit/quiz/data/*.yaml; the fields: `Question`) naming the labkit function
that computes its answer (numeric) or verifies the correct option (choice). Nothing here knows
an answer: every expected value comes from calling that function at draw time, so the bank
cannot drift from the cost models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import difflib
import math
import numbers
from pathlib import Path
import random
import re

import yaml

from labkit.quiz import articles
from labkit.quiz.articles import cite
from labkit.quiz.schema import (DEFAULT_TOLERANCE, TOPICS, files as _files,
                                resolve as _resolve, validate as _validate)
from labkit.quiz.units import convert

DATA = Path(__file__).resolve().parent / "data"
_CACHE: list | None = None
_NUMBER = re.compile(r"^\s*[~≈]?\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")


def fmt(x) -> str:
    """A number as the quiz shows it: 4 significant digits (a whole number in full up to 1e15,
    1234.6 as 1235, 0.0001234 as 0.0001234, 1.5e18 as 1.5e+18)."""
    x = float(x)
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    if 1e3 <= abs(x) < 1e15:
        return f"{x:.0f}"
    return f"{x:.4g}"


def _render(text, values: dict, where: str) -> str:
    if not text:
        return ""
    try:
        return str(text).format(**values)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"{where}: cannot render {text[:60]!r}...: {type(err).__name__} {err}; "
                         f"available: {', '.join(sorted(values))}") from None


@dataclass(frozen=True)
class Verdict:
    """The result of checking one response: `expected` and `given` in the question's unit (a
    letter for a choice question); `message` says what was right or wrong. `readable` is False
    when the response is no answer at all (empty, not a number, a unit of another kind, not an
    option): the quiz then says why and asks again, without scoring it or showing the answer."""
    correct: bool
    expected: object
    given: object
    message: str
    readable: bool = True


@dataclass
class Question:
    """One validated question of the bank.

    A question is data (labkit/quiz/data/*.yaml, schema in docs and issue 20): a statement with
    placeholders, parameters drawn per attempt from lists, and the name of a labkit function
    that computes the answer (numeric) or verifies the correct option (choice). In YAML, one
    list per file, checked by labkit.quiz.schema at load:
        id (kebab-case, unique), topic (TOPICS), difficulty (1-3), kind (numeric | choice),
        statement (may use {params} only), params ({name: [values]}, one drawn per attempt),
        explanation (may also use what the function returns), article_claim ({source: a key of
        labkit.quiz.articles.ARTICLES, wrong, why}: a popular article's wrong figure), tags;
        numeric: answer ("labkit.quiz.<module>:<function>", called with the params, returning a
        number or {"answer": number, **intermediates} in `unit`), unit, tolerance (relative,
        <= 5 %), abs_tolerance;
        choice: options ([{text, why, correct: true on exactly one}]), verify (a function
        returning {"holds": True iff the correct option's claim holds, **values for the texts}).
    """
    id: str
    topic: str
    difficulty: int
    kind: str
    statement: str
    params: dict = field(default_factory=dict)
    answer: str | None = None
    unit: str = ""
    tolerance: float = DEFAULT_TOLERANCE
    abs_tolerance: float = 0.0
    explanation: str = ""
    article_claim: dict | None = None
    tags: tuple = ()
    options: list = field(default_factory=list)
    verify: str | None = None
    source: str = ""

    def function(self):
        """The answer (numeric) or verify (choice) function."""
        key = "answer" if self.kind == "numeric" else "verify"
        return _resolve(getattr(self, key), f"{self.source}: {self.id}", key)

    def compute(self, params: dict) -> dict:
        """Call the question's function with `params`; a dict with "answer" (numeric) or
        "holds" (choice) plus any intermediates it returned."""
        where = f"{self.source}: {self.id}: {self.answer or self.verify}({params})"
        try:
            out = self.function()(**params)
        except TypeError as err:          # params and the function's arguments disagree
            raise ValueError(f"{where}: {err}") from None
        if self.kind == "numeric":
            out = dict(out) if isinstance(out, dict) else {"answer": out}
            val = out.get("answer")
            if (not isinstance(val, numbers.Real) or isinstance(val, bool)
                    or not math.isfinite(val)):
                raise ValueError(f"{where} returned answer={val!r}; it must be a finite number")
            out["answer"] = val           # an int stays an int, so "{answer}" shows 16, not 16.0
        elif not isinstance(out, dict) or "holds" not in out:
            raise ValueError(f"{where} must return a dict with a 'holds' key, got {out!r}")
        return out

    def _draw(self, seed):
        rng = random.Random(f"{self.id}:{seed}")
        return {name: rng.choice(values) for name, values in sorted(self.params.items())}, rng

    def draw_params(self, seed: int | None = 0) -> dict:
        """The params an attempt with this seed gets, without computing its answer."""
        return self._draw(seed)[0]

    def draw(self, seed: int | None = 0) -> "Attempt":
        """An attempt: params drawn with a generator seeded by (id, seed), so the same seed
        always gives the same numbers and option order (seed None: a fresh draw each time)."""
        if seed is None:
            seed = random.SystemRandom().randrange(2**32)
        params, rng = self._draw(seed)
        return Attempt(self, params, rng, seed)


class Attempt:
    """One drawn instance of a question: rendered text, the expected answer, and `check`."""

    def __init__(self, question: Question, params: dict, rng: random.Random, seed):
        q = self.question = question
        self.params, self.seed, self.kind, self.topic = params, seed, q.kind, q.topic
        where = f"{q.source}: {q.id}"
        self.values = q.compute(params)
        values = {**params, **self.values}
        self.statement = _render(q.statement, params, where).strip()
        explanation = _render(q.explanation, values, where).strip()
        if q.kind == "numeric":
            self.unit, self.options = q.unit, []
            self.expected = float(self.values["answer"])
            self.explanation = explanation
        else:
            if self.values["holds"] is not True:
                raise ValueError(f"{where}: verify says the correct option does not hold for "
                                 f"{params} ({self.values}); the question is wrong")
            order = list(range(len(q.options)))
            rng.shuffle(order)
            self.unit = ""
            shown = [q.options[i] for i in order]
            self.options = [_render(o["text"], values, where).strip() for o in shown]
            self.expected = "abcdefghijklmnopqrstuvwxyz"[
                next(k for k, o in enumerate(shown) if o.get("correct"))]
            lines = [f"({letter}) {'right' if letter == self.expected else 'wrong'}: "
                     f"{_render(o['why'], values, where).strip()}"
                     for letter, o in zip("abcdefghijklmnopqrstuvwxyz", shown)]
            self.explanation = "\n".join(lines + ([explanation] if explanation else []))
        # a popular article's wrong claim, its source cited by title and author
        claim = q.article_claim
        self.article_claim = None if claim is None else {
            "source": cite(claim["source"]),
            **{k: _render(claim[k], values, where).strip() for k in ("wrong", "why")}}

    @property
    def expected_text(self) -> str:
        """The expected answer as shown to the learner ("12.48 GB", "(b) ...")."""
        if self.kind == "choice":
            return f"({self.expected}) {self.options['abcdefghijklmnopqrstuvwxyz'.index(self.expected)]}"
        return f"{fmt(self.expected)} {self.unit}".strip()

    def check(self, response) -> Verdict:
        """Check a learner's response: for numeric, a number with an optional unit (converted
        when it is another unit of the same kind); for choice, a letter or the option's text."""
        if self.kind == "choice":
            return self._check_choice(response)
        return self._check_numeric(response)

    def _check_choice(self, response) -> Verdict:
        text = " ".join(str(response if response is not None else "").split())
        letters = "abcdefghijklmnopqrstuvwxyz"[:len(self.options)]
        m = re.fullmatch(r"\(?\s*([a-zA-Z])\s*[).]?", text)
        given = None
        if m and m.group(1).lower() in letters:
            given = m.group(1).lower()
        else:
            for letter, option in zip(letters, self.options):
                if " ".join(option.split()).lower() == text.lower():
                    given = letter
        if given is None:
            return Verdict(False, self.expected, text,
                           f"answer with one letter from {', '.join(letters)} (or the option's "
                           f"text), e.g. b or (b)", readable=False)
        ok = given == self.expected
        msg = "Correct." if ok else f"Not quite: you chose ({given}); the answer is {self.expected_text}."
        return Verdict(ok, self.expected, given, msg)

    def _check_numeric(self, response) -> Verdict:
        want = f"a number in {self.unit}" if self.unit else "a number"
        if isinstance(response, numbers.Real) and not isinstance(response, bool):
            given, unit = float(response), self.unit
        else:
            text = str(response if response is not None else "").strip()
            if "," in text:
                return Verdict(False, self.expected, text,
                               f"write a plain number (12500 or 1.25e4), not {text!r}: a comma "
                               f"could be a thousands separator or a decimal point",
                               readable=False)
            m = _NUMBER.match(text)
            if not text or not m:
                return Verdict(False, self.expected, text or None,
                               f"expected {want}, e.g. {fmt(1.5)} {self.unit}".rstrip()
                               + f"; got {text!r}", readable=False)
            given, unit = float(m.group(1)), m.group(2) or self.unit
            if unit and not self.unit:
                return Verdict(False, self.expected, text, "this answer has no unit; write "
                               f"just the number, not {unit!r}", readable=False)
        try:
            given = convert(given, unit, self.unit) if self.unit else given
        except ValueError as err:
            if unit and not self.unit:
                err = f"this answer has no unit; write just the number, not {unit!r}"
            return Verdict(False, self.expected, given, str(err), readable=False)
        if not math.isfinite(given):
            return Verdict(False, self.expected, given, f"expected {want}, got {given}",
                           readable=False)
        q = self.question
        slack = max(q.tolerance * abs(self.expected), q.abs_tolerance)
        ok = abs(given - self.expected) <= slack * (1 + 1e-12)
        shown = f"{fmt(given)} {self.unit}".strip()
        if ok:
            return Verdict(True, self.expected, given, f"Correct: {shown} (answer "
                           f"{self.expected_text}).")
        off = (given - self.expected) / self.expected if self.expected else float("inf")
        hint = f", {off:+.0%} off" if math.isfinite(off) else ""
        return Verdict(False, self.expected, given,
                       f"Not quite: you gave {shown}{hint}; the answer is {self.expected_text}.")

def load_bank(paths=None) -> list[Question]:
    """All questions of the YAML files in `paths` (files or directories; default: the package's
    data/), validated; ValueError naming the file, the id and the bad field. The default bank is
    cached."""
    global _CACHE
    if paths is None and _CACHE is not None:
        return list(_CACHE)
    seen: dict[str, str] = {}
    bank = []
    for path in _files(DATA if paths is None else paths):
        source = path.name
        try:
            entries = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ValueError(f"{source}: not valid YAML: {err}") from None
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise ValueError(f"{source}: must be a YAML list of questions")
        for raw in entries:
            q = Question(**_validate(raw, source, seen))
            seen[q.id] = source
            bank.append(q)
    if paths is None:
        _CACHE = bank
    return list(bank)


def get(qid: str) -> Question:
    """The question with id `qid`; ValueError naming the closest ids if there is none."""
    bank = {q.id: q for q in load_bank()}
    if qid not in bank:
        close = difflib.get_close_matches(str(qid), list(bank), n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(bank)} questions)"
        raise ValueError(f"id={qid!r} is not in the bank{hint}")
    return bank[qid]


def _as_set(name, value, allowed):
    values = value if isinstance(value, (list, tuple, set)) else [value]
    for v in values:
        if v not in allowed or isinstance(v, bool):
            raise ValueError(f"{name}={v!r} is not supported; allowed: "
                             f"{', '.join(map(repr, allowed))}")
    return set(values)


def select(topic=None, difficulty=None, count=None, seed=None, bank=None) -> list[Question]:
    """Questions of `topic` (a topic or a list) and `difficulty` (1..3 or a list); with `count`,
    a sample without replacement seeded by `seed` (None: a fresh draw) that covers different
    formulas before it repeats one (`spread`)."""
    pool = load_bank() if bank is None else list(bank)
    if topic is not None:
        topics = _as_set("topic", topic, TOPICS)
        pool = [q for q in pool if q.topic in topics]
    if difficulty is not None:
        levels = _as_set("difficulty", difficulty, (1, 2, 3))
        pool = [q for q in pool if q.difficulty in levels]
    if count is None:
        return pool
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise ValueError(f"count={count!r} must be a whole number >= 1")
    if count > len(pool):
        raise ValueError(f"count={count} is more than the {len(pool)} questions that match "
                         f"topic={topic!r}, difficulty={difficulty!r}")
    return spread(pool, count, random.Random(seed))


def spread(pool: list, count: int, rng: random.Random) -> list:
    """`count` questions of `pool` in a random order, no formula twice before every formula is
    drawn once: questions that share their labkit function (four pp questions all compute the
    idle share) are dealt in rounds, one per function per round, each round shuffled."""
    groups: dict = {}
    for q in pool:
        groups.setdefault(q.answer or q.verify, []).append(q)
    for group in groups.values():
        rng.shuffle(group)
    out, depth = [], 0
    while len(out) < count:
        layer = [g[depth] for g in groups.values() if len(g) > depth]
        rng.shuffle(layer)
        out += layer
        depth += 1
    return out[:count]


@dataclass(frozen=True)
class Score:
    """Correct answers out of total, overall and by topic and difficulty ({key: (correct,
    total)})."""
    correct: int
    total: int
    by_topic: dict
    by_difficulty: dict
    percent: float

    def __str__(self) -> str:
        lines = [f"Score: {self.correct}/{self.total} ({self.percent:.0f} %)"]
        for topic, (c, t) in self.by_topic.items():
            lines.append(f"  {topic:<14} {c}/{t}")
        for level, (c, t) in self.by_difficulty.items():
            lines.append(f"  difficulty {level}   {c}/{t}")
        return "\n".join(lines)


def score(results) -> Score:
    """Tally [(attempt, verdict), ...] into a Score (percent is 0 for no answers)."""
    results = list(results)
    by_topic: dict = {}
    by_level: dict = {}
    for attempt, verdict in results:
        for table, key in ((by_topic, attempt.question.topic),
                           (by_level, attempt.question.difficulty)):
            c, t = table.get(key, (0, 0))
            table[key] = (c + bool(verdict.correct), t + 1)
    correct = sum(bool(v.correct) for _, v in results)
    order = {t: i for i, t in enumerate(TOPICS)}
    return Score(correct, len(results), dict(sorted(by_topic.items(), key=lambda kv: order[kv[0]])),
                 dict(sorted(by_level.items())),
                 100.0 * correct / len(results) if results else 0.0)


def claim_attempt(question):
    """An attempt of `question` (which carries an article_claim) at the claim's own parameters,
    so its expected answer is the one to set beside the claim."""
    if not question.article_claim:
        raise ValueError(f"{question.id} carries no article claim; allowed: a question with one")
    params, rng = articles.claim_draw(question)
    return Attempt(question, params, rng, 0)
