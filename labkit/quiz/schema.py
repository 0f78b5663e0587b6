"""The schema of a bank question, checked when the YAML is loaded (labkit.quiz.bank.load_bank).

Each check raises ValueError naming the file, the question's id, the field and what is allowed,
so a typo in a data file fails at load with a message that points at it, not later in a quiz.
The schema itself is in `labkit.quiz.bank.Question`'s docstring and issue 20's contract.
"""
from __future__ import annotations

import importlib
import numbers
import math
from pathlib import Path
import re
import string

from labkit.quiz.articles import ARTICLES

TOPICS = ("memory", "collectives", "ddp", "zero-fsdp", "tp", "pp", "3d", "checkpointing",
          "precision", "mfu", "hardware", "moe", "trace")
KINDS = ("numeric", "choice")
_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_KEYS = {"id", "topic", "difficulty", "kind", "statement", "params", "answer", "unit",
         "tolerance", "abs_tolerance", "explanation", "article_claim", "tags", "options", "verify"}
_NEEDED = {"numeric": ("answer", "unit"), "choice": ("options", "verify")}
_ONLY = {"numeric": ("options", "verify"), "choice": ("answer", "unit", "tolerance",
                                                      "abs_tolerance")}
DEFAULT_TOLERANCE = 0.01
MAX_TOLERANCE = 0.05     # a looser check would pass answers off by 10 %, which the tests refuse


def resolve(ref: str, where: str, key: str):
    """The function a question names, 'labkit.quiz.<module>:<function>'."""
    if not isinstance(ref, str) or ":" not in ref or not ref.startswith("labkit.quiz."):
        raise ValueError(f"{where}: {key}={ref!r} must be 'labkit.quiz.<module>:<function>'")
    module, _, name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}: {key}={ref!r} cannot be found ({err})") from None
    if not callable(fn):
        raise ValueError(f"{where}: {key}={ref!r} is not a function")
    return fn

def fields(text: str) -> set[str]:
    """The placeholder names in a format string ({x:.2f} -> x)."""
    names = set()
    for _, name, _, _ in string.Formatter().parse(text):
        if name:
            names.add(re.split(r"[.\[]", name)[0])
    return names

def validate(raw, source: str, seen: dict) -> dict:
    """The fields of one YAML entry, checked (ValueError naming file, id, field); `seen` maps
    the ids loaded so far to their files."""
    where = f"{source}: {raw.get('id', '<no id>') if isinstance(raw, dict) else '<entry>'}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: each entry must be a mapping, got {type(raw).__name__}")
    bad = set(raw) - _KEYS
    if bad:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(bad))}; allowed: "
                         f"{', '.join(sorted(_KEYS))}")
    qid = raw.get("id")
    if not isinstance(qid, str) or not _ID.match(qid):
        raise ValueError(f"{where}: id={qid!r} must be kebab-case (lowercase words and digits "
                         f"joined by '-')")
    if qid in seen:
        raise ValueError(f"{where}: id={qid!r} is used twice (also in {seen[qid]})")
    if raw.get("topic") not in TOPICS:
        raise ValueError(f"{where}: topic={raw.get('topic')!r} is not one of {', '.join(TOPICS)}")
    if raw.get("difficulty") not in (1, 2, 3) or isinstance(raw.get("difficulty"), bool):
        raise ValueError(f"{where}: difficulty={raw.get('difficulty')!r} must be 1, 2 or 3")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind={kind!r} must be one of {', '.join(KINDS)}")
    for key in _NEEDED[kind]:
        if key not in raw:
            raise ValueError(f"{where}: field {key!r} is required for a {kind} question")
    for key in _ONLY[kind]:
        if key in raw:
            raise ValueError(f"{where}: field {key!r} is not allowed in a {kind} question")
    statement = raw.get("statement")
    if not isinstance(statement, str) or not statement.strip():
        raise ValueError(f"{where}: statement must be non-empty text")
    params = raw.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: params must map a name to a list of values")
    for name, values in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{where}: params name {name!r} must be an identifier")
        if not isinstance(values, list) or not values or any(
                isinstance(v, (dict, list)) or v is None for v in values):
            raise ValueError(f"{where}: params.{name}={values!r} must be a non-empty list of "
                             f"numbers or strings")
    unknown = fields(statement) - set(params)
    if unknown:
        raise ValueError(f"{where}: statement uses {', '.join(sorted(unknown))}, which are not "
                         f"params (only params may appear in a statement)")
    for key in ("explanation",):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"{where}: {key} must be text")
    tol = raw.get("tolerance", DEFAULT_TOLERANCE)
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 <= tol <= MAX_TOLERANCE:
        raise ValueError(f"{where}: tolerance={tol!r} must be a relative tolerance from 0 to "
                         f"{MAX_TOLERANCE}")
    abs_tol = raw.get("abs_tolerance", 0.0)
    if isinstance(abs_tol, bool) or not isinstance(abs_tol, numbers.Real) or abs_tol < 0 \
            or not math.isfinite(abs_tol):
        raise ValueError(f"{where}: abs_tolerance={abs_tol!r} must be a number >= 0")
    if kind == "numeric" and not isinstance(raw["unit"], str):
        raise ValueError(f"{where}: unit={raw['unit']!r} must be text ('' for a plain count)")
    options = raw.get("options") or []
    if kind == "choice":
        if not isinstance(options, list) or not 2 <= len(options) <= 26:
            raise ValueError(f"{where}: options must be a list of 2 to 26 options")
        for i, o in enumerate(options):
            if not isinstance(o, dict) or set(o) - {"text", "why", "correct"}:
                raise ValueError(f"{where}: options[{i}] must have only text, why, correct")
            for k in ("text", "why"):
                if not isinstance(o.get(k), str) or not o[k].strip():
                    raise ValueError(f"{where}: options[{i}].{k} is missing; every option needs "
                                     f"a text and a why (why a wrong option is wrong)")
            if "correct" in o and o["correct"] is not True:
                raise ValueError(f"{where}: options[{i}].correct must be true or absent")
        n = sum(1 for o in options if o.get("correct"))
        if n != 1:
            raise ValueError(f"{where}: options has {n} correct options; exactly one is allowed")
    claim = raw.get("article_claim")
    if claim is not None:
        if not isinstance(claim, dict) or set(claim) != {"source", "wrong", "why"} or not all(
                isinstance(v, str) and v.strip() for v in claim.values()):
            raise ValueError(f"{where}: article_claim must have exactly source, wrong, why "
                             "(text)")
        if claim["source"] not in ARTICLES:
            raise ValueError(f"{where}: article_claim.source={claim['source']!r} is not a known "
                             f"article; allowed: {', '.join(ARTICLES)} (labkit/quiz/articles.py)")
    tags = raw.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"{where}: tags must be a list of words")
    ref = "answer" if kind == "numeric" else "verify"
    resolve(raw[ref], where, ref)   # now, so a misspelt function fails at load, naming the file
    return dict(id=qid, topic=raw["topic"], difficulty=raw["difficulty"], kind=kind,
                statement=statement, params=dict(params), answer=raw.get("answer"),
                unit=raw.get("unit", ""), tolerance=float(tol), abs_tolerance=float(abs_tol),
                explanation=raw.get("explanation") or "", article_claim=claim, tags=tuple(tags),
                options=list(options), verify=raw.get("verify"), source=source)


def files(paths) -> list[Path]:
    """The YAML files of `paths` (a file, a directory or a list of them), in order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(p.glob("*.yaml"))
        elif p.is_file():
            found.append(p)
        else:
            raise ValueError(f"paths: {str(p)!r} is neither a YAML file nor a directory")
    return found


