"""Checks that exercise notebooks call: each says precisely what is wrong, with numbers.

    from labkit.course import grading
    grading.check_close("ex2", answer_bytes, 7e9 * 16, unit="bytes",
                        hint="which states mixed-precision AdamW keeps, and in which dtypes")
    grading.check_callable("ex1", param_count, cases=[(768, 12), (1024, 24)],
                           reference=lambda h, n: 12 * n * h * h)

A passed check prints one line (``✓ ex2: ...``); a failed one raises `GradingError`, whose
message says expected vs received (the class says how).
"""
from __future__ import annotations

# This module runs inside the grading kernel and in learners' notebooks: it imports nothing
# heavy (torch only inside ``check_tensor_close``, and only when a tensor is compared).
import math
import numbers
from collections.abc import Callable, Iterable, Mapping

from labkit.course.verdict import Opaque

__all__ = [
    "GradingError",
    "NOT_ATTEMPTED",
    "check",
    "check_equal",
    "check_close",
    "check_int",
    "check_callable",
    "check_raises",
    "check_tensor_close",
    "format_value",
    "JUDGED",
    "decide",
]

NOT_ATTEMPTED = "exercise not attempted yet"
_GB, _GIB = 1e9, 2.0**30


class GradingError(AssertionError):
    """A check failed. ``str(err)`` is the whole explanation; the parts are kept as attributes.

    The message names the check, the expected and the received value (bytes shown as GB and
    GiB, both), their ratio when both are numbers (with the usual suspects: a factor of 2, GB vs
    GiB, bits vs bytes), and what to look at (``hint``). A learner function that still raises
    the stub's ``NotImplementedError`` gives "exercise not attempted yet" (NOT_ATTEMPTED)."""

    def __init__(self, message: str, *, name: str | None = None, expected=None, received=None,
                 hint: str | None = None):
        super().__init__(message)
        self.name = name
        self.expected = expected
        self.received = received
        self.hint = hint

    def _title(self) -> str:
        return f"check {self.name} failed" if self.name else "check failed"

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error: the message alone, styled as feedback (no
        traceback through this module); the cell still counts as failed."""
        lines = str(self).splitlines() or [""]
        if self.name and lines[0].startswith(f"{self.name}: "):
            lines[0] = lines[0][len(self.name) + 2:]
        return ([f"\x1b[1;31m\u2717 {self._title()}\x1b[0m"] + lines
                + _learner_frames(self.__cause__))


def _learner_frames(cause, keep: int = 3) -> list[str]:
    """Where in the learner's code `cause` (what their function raised) came from."""
    if cause is None or isinstance(cause, NotImplementedError):
        return []
    import os
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if not f.filename.startswith(here)]
    return [f"  in {f.name}, line {f.lineno}: {(f.line or '').strip()}" for f in frames[-keep:]]


# ----------------------------------------------------------------------------------- formatting

# ------------------------------------------------------------------------------- plain values
# A check compares plain values only: what an answer returns is copied into builtins (numbers,
# strings, lists, dicts) with the builtin types' own methods, so no method of the answer's
# (an `__eq__` that always says yes, an `__float__` that reads the check's frame) runs while a
# check holds its expected value.

_EXACT = (int, float, complex, str, bytes, bool, type(None))


def plain(value, _depth: int = 0):
    """`value` as builtins, read through the builtin types' own slots (never a subclass's
    methods): int, float, str, list, tuple, dict, set subclasses become their base; numpy
    scalars and arrays, `.item()` / `.tolist()`; a torch tensor (exact type) stays a tensor;
    anything else an `Opaque`."""
    kind = type(value)
    if kind in _EXACT:
        return value
    if _depth > 50:
        return Opaque("structure nested too deep")
    for base, copy in ((bool, bool.__bool__), (int, int.__int__), (float, float.__float__),
                       (str, str.__str__)):
        if issubclass(kind, base):
            return copy(value)
    if issubclass(kind, (list, tuple)):
        items = [plain(x, _depth + 1) for x in (list.__iter__(value) if issubclass(kind, list)
                                                 else tuple.__iter__(value))]
        return items if issubclass(kind, list) else tuple(items)
    if issubclass(kind, dict):
        return {plain(k, _depth + 1): plain(v, _depth + 1) for k, v in dict.items(value)}
    if issubclass(kind, (set, frozenset)):
        return frozenset(plain(x, _depth + 1) for x in (set.__iter__(value) if issubclass(kind, set)
                                                         else frozenset.__iter__(value)))
    module = type.__dict__["__module__"].__get__(kind)       # not a metaclass's property
    module = module if type(module) is str else ""
    if module == "numpy" and hasattr(kind, "tolist"):
        return plain(value.tolist(), _depth + 1)      # numpy's own types: C methods
    if module.startswith("torch") and kind.__name__ in ("Tensor", "Parameter"):
        return value
    if module in ("fractions", "decimal"):
        return float(value)
    return Opaque(kind.__name__)


def _short_repr(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 20] + " ... " + text[-12:]


def _as_number(value):
    """A real number for ints, floats, numpy scalars and one-element tensors; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            numel = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)
            if numel == 1:
                got = item()
                if isinstance(got, numbers.Real) and not isinstance(got, bool):
                    return got
        except Exception:  # noqa: BLE001 - anything odd is simply "not a number"
            return None
    return None


def _num(x: float) -> str:
    if isinstance(x, numbers.Integral):
        return f"{int(x):,}"
    if math.isfinite(x) and float(x).is_integer() and abs(x) < 1e16:
        return f"{int(x):,}"
    return f"{x:.6g}"


def _scaled(x: float, base: float, names: list[str]) -> str:
    """x in the largest unit of `names` (powers of `base`) that keeps it >= 1."""
    power = 0
    while power + 1 < len(names) and abs(x) >= base ** (power + 1):
        power += 1
    return f"{x / base ** power:.4g} {names[power]}"


def format_value(value, unit: str | None = None) -> str:
    """How a check shows a value: bytes as 'N bytes (x GB = y GiB)', rates in GB/s, others plain."""
    number = _as_number(value)
    if number is None:
        return _short_repr(value)
    if unit in ("bytes", "B", "byte"):
        if abs(number) < 1000:
            return f"{_num(number)} bytes"
        decimal = _scaled(number, 1000.0, ["bytes", "kB", "MB", "GB", "TB", "PB"])
        binary = _scaled(number, 1024.0, ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"])
        return f"{_num(number)} bytes ({decimal} = {binary})"
    if unit in ("bytes/s", "B/s"):
        return f"{_num(number)} bytes/s ({_scaled(number, 1000.0, ['B/s', 'kB/s', 'MB/s', 'GB/s', 'TB/s'])})"
    if unit in ("FLOPs", "FLOP", "flops"):
        return f"{_num(number)} FLOPs ({number:.4g})"
    if unit:
        return f"{_num(number)} {unit}"
    return _num(number)


def _ratio_note(ratio: float) -> str:
    """The usual reason for a ratio: GB vs GiB, bits vs bytes, unit prefixes, a whole factor."""
    def near(a, b):
        return math.isclose(a, b, rel_tol=2e-3)

    if near(ratio, _GIB / _GB):
        return "GiB vs GB? received / expected = 2**30 / 1e9"
    if near(ratio, _GB / _GIB):
        return "GB vs GiB? received / expected = 1e9 / 2**30"
    for k, what in ((8, "bits vs bytes?"), (1000, "a unit prefix (k/M/G) off by one step?"),
                    (1e6, "a unit prefix off by two steps?"), (1e9, "bytes vs GB?"),
                    (1024, "KiB vs bytes?")):
        if near(ratio, k):
            return f"received is {k:g}x expected: {what}"
        if near(ratio, 1 / k):
            return f"received is 1/{k:g} of expected: {what}"
    for k in range(2, 129):
        if near(ratio, k):
            return f"received is {k}x expected"
        if near(ratio, 1 / k):
            return f"received is 1/{k} of expected"
    return ""


def _comparison(expected, received, unit: str | None) -> list[str]:
    lines = [f"  expected: {format_value(expected, unit)}",
             f"  received: {format_value(received, unit)}"]
    e, r = _as_number(expected), _as_number(received)
    if e is not None and r is not None and e != 0 and math.isfinite(e) and math.isfinite(r):
        ratio = r / e
        note = _ratio_note(ratio)
        lines.append(f"  ratio received/expected: {ratio:.4g}" + (f" ({note})" if note else ""))
    return lines


def _fail(name: str, what: str, *, expected=None, received=None, unit=None, hint=None,
          compare: bool = True, extra: Iterable[str] = ()) -> GradingError:
    lines = [f"{name}: {what}"]
    if compare:
        lines += _comparison(expected, received, unit)
    lines += list(extra)
    if hint:
        lines.append(f"  look at: {hint}")
    return GradingError("\n".join(lines), name=name, expected=expected, received=received, hint=hint)


def _passed(name: str, detail: str = "") -> None:
    print(f"\u2713 {name}" + (f": {detail}" if detail else ""))


# --------------------------------------------------------------------------------------- checks
# Each check is two halves: what it *received* (plain values, copied in the kernel that runs
# the answer) and the decision (`_decide_*`, plain values in, GradingError out). In a grading
# kernel (labkit.course.grader) a check also records what it received (`_record`), and where
# the grader took its expected value out of the kernel (`JUDGED`), records only: the grader
# decides, in its own process, against the expected values of a run of the solutions
# (labkit.course.verdict).

class _Judged:
    def __repr__(self) -> str:
        return "<expected value: decided by the grader>"


JUDGED = _Judged()          # an expected value that only the grader's process holds
_GRADE_RUN = "LABKIT_GRADE_RUN"     # labkit.course.kernel.ENV_GRADE_RUN: set in grading kernels


def _record(kind: str, name: str, expected=None, **fields) -> bool:
    """In a grading kernel, publish what this check received (labkit.course.verdict.MIME);
    True when the expected value is the grader's (`JUDGED`): nothing to decide here."""
    import os

    judged = expected is JUDGED
    if os.environ.get(_GRADE_RUN) and _PUBLISH:
        from labkit.course import verdict

        record = {"kind": kind, "name": name}
        if not judged:
            fields["expected"] = expected
        for key, value in fields.items():
            record[key] = verdict.encode(value if key in ("calls", "results") else plain(value))
        _PUBLISH[0](data={verdict.MIME: verdict.dumps(record)}, metadata={})
    return judged


def _publisher() -> list:
    """[IPython's display publisher, bound now]: taken when this module is first imported (in
    a grading kernel, before any answer runs), so an answer that replaces the shell's
    publisher later does not see the records."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    return [shell.display_pub.publish] if shell is not None else []


_PUBLISH = _publisher()


def _decide_check(name, condition, message, hint=None):
    if isinstance(condition, Opaque) or not condition:
        raise _fail(name, message, compare=False, hint=hint)


def check(name: str, condition, message: str, *, hint: str | None = None) -> None:
    """Pass when `condition` is true; else fail with `message` (say what was expected)."""
    condition = plain(condition)
    _record("check", name, condition=condition, message=str(message), hint=hint)
    _decide_check(name, condition, message, hint)
    _passed(name)


def _decide_equal(name, received, expected, hint=None):
    try:
        equal = bool(received == expected)
    except Exception:  # noqa: BLE001 - e.g. an array's ambiguous truth value
        equal = False
    if not equal:
        extra = []
        if type(received) is not type(expected):
            extra.append(f"  types: expected {type(expected).__name__}, "
                         f"received {type(received).__name__}")
        raise _fail(name, "wrong value", expected=expected, received=received, hint=hint,
                    extra=extra)


def check_equal(name: str, received, expected, *, hint: str | None = None) -> None:
    """Pass when ``received == expected`` (exact; use check_close for floats)."""
    received = plain(received)
    if _record("equal", name, expected, received=received, hint=hint):
        return
    _decide_equal(name, received, expected, hint)
    _passed(name, _short_repr(received, 80))


def _decide_close(name, received, expected, rtol=1e-6, atol=0.0, unit=None, hint=None):
    number = _as_number(received)
    if number is None:
        raise _fail(name, f"expected a number, received {_short_repr(received)} "
                          f"(a {type(received).__name__})",
                    expected=expected, received=received, unit=unit, hint=hint, compare=False,
                    extra=[f"  expected: {format_value(expected, unit)}"])
    if not math.isfinite(number) or not math.isclose(number, expected, rel_tol=rtol, abs_tol=atol):
        tol = f"relative tolerance {rtol:g}" + (f", absolute {atol:g}" if atol else "")
        raise _fail(name, f"wrong value ({tol})", expected=expected, received=number, unit=unit,
                    hint=hint)
    return number


def check_close(name: str, received, expected, *, rtol: float = 1e-6, atol: float = 0.0,
                unit: str | None = None, hint: str | None = None) -> None:
    """Pass when `received` is a number within ``rtol`` (relative) or ``atol`` of `expected`.

    unit: "bytes" (shown as GB and GiB), "bytes/s", "s", "FLOPs" or any label.
    """
    received = plain(received)
    if _record("close", name, expected, received=received, rtol=rtol, atol=atol, unit=unit,
               hint=hint):
        return
    number = _decide_close(name, received, expected, rtol, atol, unit, hint)
    _passed(name, format_value(number, unit))


def _decide_int(name, received, expected, unit=None, hint=None):
    number = _as_number(received)
    if number is None or not float(number).is_integer():
        raise _fail(name, f"expected a whole number, received {_short_repr(received)} "
                          f"(a {type(received).__name__})",
                    hint=hint, compare=False, extra=[f"  expected: {format_value(expected, unit)}"])
    if int(number) != int(expected):
        raise _fail(name, "wrong value", expected=expected, received=int(number), unit=unit,
                    hint=hint)
    return int(number)


def check_int(name: str, received, expected: int, *, unit: str | None = None,
              hint: str | None = None) -> None:
    """Pass when `received` is a whole number equal to `expected` (a float like 7.0 is accepted)."""
    received = plain(received)
    if _record("int", name, expected, received=received, unit=unit, hint=hint):
        return
    _passed(name, format_value(_decide_int(name, received, expected, unit, hint), unit))


def _is_tensor(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "shape")


def _same(received, expected, rtol, atol) -> bool:
    if _is_tensor(expected) or _is_tensor(received):
        import torch

        if not (isinstance(received, torch.Tensor) and isinstance(expected, torch.Tensor)):
            return False
        if received.shape != expected.shape:
            return False
        return bool(torch.allclose(received.detach().double().cpu(), expected.detach().double().cpu(),
                                   rtol=rtol if rtol is not None else 1e-5, atol=atol or 1e-8))
    r, e = _as_number(received), _as_number(expected)
    if r is not None and e is not None:
        if (rtol is None and isinstance(r, numbers.Integral) and isinstance(e, numbers.Integral)):
            return r == e
        return math.isclose(r, e, rel_tol=1e-9 if rtol is None else rtol, abs_tol=atol)
    if isinstance(expected, Mapping):
        return (isinstance(received, Mapping) and set(received) == set(expected)
                and all(_same(received[k], expected[k], rtol, atol) for k in expected))
    if isinstance(expected, (list, tuple)):
        return (isinstance(received, (list, tuple)) and len(received) == len(expected)
                and all(_same(a, b, rtol, atol) for a, b in zip(received, expected)))
    try:
        return bool(received == expected)
    except Exception:  # noqa: BLE001
        return False


def _split_case(case):
    if isinstance(case, Mapping):
        return (), dict(case)
    if isinstance(case, tuple):
        if len(case) == 2 and isinstance(case[0], tuple) and isinstance(case[1], Mapping):
            return case[0], dict(case[1])
        return case, {}
    return (case,), {}


def _call_text(fn, args, kwargs) -> str:
    parts = [_short_repr(a, 60) for a in args] + [f"{k}={_short_repr(v, 60)}" for k, v in kwargs.items()]
    return f"{getattr(fn, '__name__', 'function')}({', '.join(parts)})"


def _not_attempted(name: str, call: str, why) -> GradingError:
    return _fail(name, f"{NOT_ATTEMPTED}: {call} still raises NotImplementedError({why})",
                 compare=False, extra=["  replace the line `raise NotImplementedError(...)` "
                                       "in the exercise cell with your code"])


def _decide_callable(name, calls, results, expected, rtol=None, atol=0.0, unit=None, hint=None,
                     not_callable=None, **_):
    """results[i]: {"v": value} or {"raised": type name, "text": str} or {"not_attempted": str}."""
    if not_callable is not None:
        raise _fail(name, f"expected a function, received {not_callable}", compare=False,
                    hint=hint)
    stopped = bool(results) and not ("v" in results[-1])      # raised, or not attempted
    if len(calls) != len(results) or len(results) > len(expected) or (
            len(results) < len(expected) and not stopped):
        raise _fail(name, f"the check's record has {len(results)} results for "
                          f"{len(expected)} cases: does your code change how checks report? "
                          "Answers may not", compare=False)
    for call, result, want in zip(calls, results, expected):
        if "not_attempted" in result:
            raise _not_attempted(name, call, result["not_attempted"])
        if "raised" in result:
            raise _fail(name, f"{call} raised {result['raised']}: {result['text']}",
                        compare=False, extra=[f"  expected it to return {format_value(want, unit)}"],
                        hint=hint)
        if not _same(result["v"], want, rtol, atol):
            raise _fail(name, f"wrong result for {call}", expected=want, received=result["v"],
                        unit=unit, hint=hint)


def check_callable(name: str, fn: Callable, cases: Iterable, reference: Callable, *,
                   rtol: float | None = None, atol: float = 0.0, unit: str | None = None,
                   hint: str | None = None, mistakes: str | None = None) -> None:
    """Call the learner's `fn` on each case and compare with ``reference`` on the same case.

    A case is an argument (``4096``), a tuple of positional arguments (``(4096, 32)``), a dict of
    keyword arguments, or ``(args_tuple, kwargs_dict)``. Results are compared exactly for whole
    numbers and other values, within ``rtol`` (default 1e-9) for floats, elementwise for lists,
    tuples, dicts and tensors. The learner's `fn` runs on every case before the reference runs
    on any (its answers copied to plain values), so nothing `fn` can reach holds an expected
    value. `mistakes`: the key of labkit.course.reference.MISTAKES whose labels the grader
    names when a wrong result is one of them.
    """
    spec = dict(rtol=rtol, atol=atol, unit=unit, hint=hint, mistakes=mistakes)
    if not callable(fn):
        text = f"{_short_repr(fn)} (a {type(fn).__name__})"
        _record("callable", name, None if reference is JUDGED else [], calls=[], results=[],
                not_callable=text, **spec)
        raise _fail(name, f"expected a function, received {text}", compare=False, hint=hint)
    cases = [_split_case(case) for case in cases]
    calls, results, causes = [], [], []
    for args, kwargs in cases:
        calls.append(_call_text(fn, args, kwargs))
        try:
            results.append({"v": plain(fn(*args, **kwargs))})
        except GradingError:
            raise                   # e.g. the grader refused a call (labkit.course.forbid)
        except NotImplementedError as exc:
            _record("callable", name, JUDGED if reference is JUDGED else None, calls=calls,
                    results=[*results, {"not_attempted": str(exc)}], cases=cases, **spec)
            raise _not_attempted(name, calls[-1], exc) from exc
        except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
            results.append({"raised": type(exc).__name__, "text": str(exc)})
            causes.append(exc)
            break
    expected = (JUDGED if reference is JUDGED
                else [reference(*args, **kwargs) for args, kwargs in cases])
    if _record("callable", name, expected, calls=calls, results=results, cases=cases, **spec):
        return
    try:
        _decide_callable(name, calls, results, expected, **spec)
    except GradingError as err:
        raised = causes and str(err).startswith(f"{name}: {calls[-1]} raised")
        raise err from (causes[0] if raised else None)
    _passed(name, f"{len(cases)} case{'s' if len(cases) != 1 else ''} agree with the reference")


def _decide_raises(name, call, outcome, exception, why="", hint=None, not_attempted=None):
    if not_attempted is not None:
        raise _not_attempted(name, call, not_attempted)
    if outcome is not None:
        raise _fail(name, f"{call} {outcome}; expected {exception}" + (f": {why}" if why else ""),
                    compare=False, hint=hint)


def check_raises(name: str, fn: Callable, args: tuple, exception: type[BaseException], *,
                 reference: Callable | None = None, why: str = "", hint: str | None = None) -> None:
    """Pass when ``fn(*args)`` raises `exception`. `reference`, when given, must raise it too
    (else the check itself is wrong: AssertionError). `why` says why it must raise."""
    if reference is not None and reference is not JUDGED:
        try:
            reference(*args)
        except exception:
            pass
        else:
            raise AssertionError(f"{name}: the reference does not raise {exception.__name__} "
                                 f"for {args!r}")
    call = _call_text(fn, args, {})
    outcome, not_attempted = None, None
    try:
        got = fn(*args)
    except exception:
        pass
    except GradingError:
        raise
    except NotImplementedError as exc:
        not_attempted = str(exc)
    except Exception as exc:  # noqa: BLE001 - say what the learner's code did instead
        outcome = f"raised {type(exc).__name__}: {exc}"
    else:
        outcome = f"returned {_short_repr(got)}"
    spec = dict(exception=exception.__name__, why=why, hint=hint)
    if _record("raises", name, JUDGED if reference is JUDGED else None, call=call,
               outcome=outcome, not_attempted=not_attempted, **spec):
        return
    _decide_raises(name, call, outcome, not_attempted=not_attempted, **spec)
    _passed(name, f"{call} raises {exception.__name__}")


def _decide_tensor(name, received, expected, rtol=1e-5, atol=1e-8, hint=None):
    import torch

    if not isinstance(received, torch.Tensor):
        raise _fail(name, f"expected a tensor of shape {tuple(expected.shape)}, received "
                          f"{_short_repr(received)} (a {type(received).__name__})",
                    compare=False, hint=hint)
    if received.shape != expected.shape:
        raise _fail(name, "wrong shape", compare=False, hint=hint,
                    extra=[f"  expected shape: {tuple(expected.shape)}",
                           f"  received shape: {tuple(received.shape)}"])
    r = received.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if torch.allclose(r, e, rtol=rtol, atol=atol):
        return
    bad = ~torch.isclose(r, e, rtol=rtol, atol=atol)
    diff = (r - e).abs().nan_to_num(nan=math.inf)
    flat = int(torch.argmax(diff))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape)) if r.dim() else ()
    extra = [f"  {int(bad.sum())} of {r.numel()} elements differ "
             f"(relative tolerance {rtol:g}, absolute {atol:g})",
             f"  largest difference at index {index}: expected {e[index].item():.6g}, "
             f"received {r[index].item():.6g}"]
    if received.dtype != expected.dtype:
        extra.append(f"  dtypes: expected {expected.dtype}, received {received.dtype}")
    if torch.isnan(r).any():
        extra.append("  received contains NaN")
    raise _fail(name, "tensor values differ", compare=False, hint=hint, extra=extra)


def check_tensor_close(name: str, received, expected, *, rtol: float = 1e-5, atol: float = 1e-8,
                       hint: str | None = None) -> None:
    """Pass when `received` is a tensor of `expected`'s shape and close to it elementwise
    (``torch.allclose`` in float64). Failing says where the largest difference is."""
    received = plain(received)
    if _record("tensor", name, expected, received=received, rtol=rtol, atol=atol, hint=hint):
        return
    _decide_tensor(name, received, expected, rtol, atol, hint)
    _passed(name, f"shape {tuple(received.shape)}")


# ------------------------------------------------------------------ the grader's side: decide

_DECIDE = {   # kind: (decision, the learner's fields, the judge's fields)
    "check": (_decide_check, ("condition", "message"), ("hint",)),
    "equal": (_decide_equal, ("received",), ("expected", "hint")),
    "close": (_decide_close, ("received",), ("expected", "rtol", "atol", "unit", "hint")),
    "int": (_decide_int, ("received",), ("expected", "unit", "hint")),
    "tensor": (_decide_tensor, ("received",), ("expected", "rtol", "atol", "hint")),
    "callable": (_decide_callable, ("calls", "results", "not_callable"),
                 ("expected", "rtol", "atol", "unit", "hint")),
    "raises": (_decide_raises, ("call", "outcome", "not_attempted"), ("exception", "why", "hint")),
}


def decide(kind: str, name: str, received: Mapping, expected: Mapping) -> None:
    """Decide a check from records (labkit.course.verdict): `received`, the learner kernel's;
    `expected`, the judge's. Raises GradingError with the check's own message."""
    from labkit.course.verdict import decode

    if kind not in _DECIDE:
        raise GradingError(f"{name}: an unknown kind of check {kind!r}", name=name)
    fn, mine, theirs = _DECIDE[kind]
    args = {k: decode(received.get(k)) for k in mine}
    args.update({k: decode(expected.get(k)) for k in theirs})
    if kind == "callable" and args["expected"] is None:
        args["expected"] = []
    fn(name, **args)
