"""The judge: a template's expected values, from the solutions run in a kernel of their own.

    judge = load(key(digest)) or from_runs(layout.checks, runs_of_the_solutions)
    judge.message(check_cell_index, learner_records)    # None: passed

The learner's kernel never holds an expected value (labkit.course.grader swaps them for
`grading.JUDGED`); they come from a run of the solutions notebook itself, kept per template,
labkit, Python and torch (`key`) in a cache that the grading kernel may not read
(labkit.course.forbid protects it as it protects the solutions).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from labkit.course import grading, reference, verdict

CACHE_ENV = "LABKIT_JUDGE_CACHE"
_VERSION = 1
_PACKAGE = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    """Where judges are kept: $LABKIT_JUDGE_CACHE, else ~/.cache/labkit/judge."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "labkit" / "judge")


def _labkit_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(_PACKAGE.rglob("*.py")):
        if "__pycache__" not in p.parts:
            h.update(str(p.relative_to(_PACKAGE)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def key(template_digest: str) -> str:
    """The judge of a template is the same as long as the template, labkit, Python and torch
    are (the expected values are computed with them)."""
    try:
        from importlib.metadata import version

        torch = version("torch")
    except Exception:  # noqa: BLE001 - no torch: the checks that need it fail anyway
        torch = "none"
    h = hashlib.sha256()
    for part in (str(_VERSION), template_digest, _labkit_digest(),
                 sys.version, platform.machine(), torch):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


@dataclass
class Judge:
    records: dict[int, list[dict]] = field(default_factory=dict)   # check cell -> its records
    failures: dict[int, str] = field(default_factory=dict)        # check cell -> why it failed
    cached: bool = False

    def message(self, index: int, learner: list[dict]) -> str | None:
        """The check cell `index`'s first failing record (learner's against the judge's)."""
        if index in self.failures:
            return ("the reference solution failed this check when the grader ran it, so it "
                    f"cannot judge yours (not your answer's fault): {self.failures[index]}")
        return first_failure(learner, self.records.get(index, []))


def first_failure(learner: list[dict], judged: list[dict]) -> str | None:
    """The first of the learner's records, in order, that fails against the judge's; also a
    record the judge has no counterpart for."""
    for i, record in enumerate(learner):
        if i >= len(judged):
            return (f"{record.get('name') or 'the check'}: the check reported more results "
                    f"({len(learner)}) than it makes ({len(judged)}): does your code call the "
                    "checks (labkit.course.grading)? Answers may not")
        if record.get("kind") in ("too many", "unreadable"):
            return (f"the check's results could not be read ({record['kind']}): does your code "
                    "publish display data of the checks' kind? Answers may not")
        message = decide(record, judged[i])
        if message:
            return message
    return None


def from_runs(checks, runs) -> Judge:
    """The judge of a run of the solutions: per check cell, its records, or why it failed (an
    error, or a record that fails against itself)."""
    judge = Judge()
    for c in checks:
        run = runs[c.index]
        records = list(run.records)
        why = None
        if not run.ran or run.timed_out or run.died or run.killed:
            why = "it did not run to its end"
        elif run.error:
            why = f"{run.error['ename']}: {run.error['evalue']}"
        else:
            why = first_failure(records, records)
        if why:
            judge.failures[c.index] = why
        judge.records[c.index] = records
    return judge


def load(name: str) -> Judge | None:
    try:
        data = json.loads((cache_dir() / f"{name}.json").read_text())
        if data.get("version") != _VERSION:
            return None
        return Judge({int(k): v for k, v in data["records"].items()}, cached=True)
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def save(name: str, judge: Judge) -> None:
    """Keep a judge with no failure (a failed one is run again next time)."""
    if judge.failures:
        return
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".judge-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _VERSION, "records": judge.records}, f)
        os.replace(tmp, directory / f"{name}.json")
    except OSError:
        pass        # no cache: the next grade runs the solutions again


def decide(learner: dict, judge: dict) -> str | None:
    """None when the learner's record passes against the judge's; else the message (the
    checks' own: labkit.course.grading). Expected values, tolerances and hints are the
    judge's; what was received, and a `check`'s own message, the learner's."""
    name = judge.get("name") or learner.get("name") or "check"
    if learner.get("too_large"):
        return (f"{name}: the value your code gave is too large for the grader "
                f"({learner['too_large'] / 1e6:.1f} MB as data)")
    if learner.get("kind") != judge.get("kind"):
        return (f"{name}: the check reported a {learner.get('kind')!r} result where the "
                f"reference run reported {judge.get('kind')!r} (does your code call the checks?)")
    try:
        grading.decide(judge["kind"], name, received=learner, expected=judge)
    except grading.GradingError as err:
        label = _known_mistake(learner, judge) if judge.get("mistakes") else None
        return str(err) + (f"\n  that is a known mistake: {label}" if label else "")
    return None


def _known_mistake(learner: dict, judge: dict) -> str | None:
    """labkit.course.reference.mistake_label over the learner's results and the judge's cases
    and expected values."""
    mistakes = reference.MISTAKES.get(verdict.decode(judge["mistakes"]), ())
    cases = verdict.decode(judge.get("cases")) or []
    results, wants = verdict.decode(learner.get("results")) or [], verdict.decode(judge.get("expected")) or []
    rows = ((args, kwargs, r.get("v"), want)
            for (args, kwargs), r, want in zip(cases, results, wants))
    return reference.mistake_label(rows, mistakes, verdict.decode(judge.get("rtol")))
