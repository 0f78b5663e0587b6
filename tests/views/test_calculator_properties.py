"""Every input reaches the learner as a message (issue 11, point 11): whatever a learner (or a
notebook cell) sets the calculators' controls to, in their ranges, at 0, negative, inf, -inf,
nan, huge (1e200, 1e308, a 400-digit number), not a number at all or empty, no exception
escapes, the calculator shows a result or a message (never both, never a stale one), every number
it prints is finite and readable, and the figure is hidden in the error state and drawn from
finite data otherwise.

Rendering a figure to PNG costs 0.1-0.3 s (matplotlib's log-axis ticks), too slow for a few
hundred changes, so while these properties run the calculators' `png_bytes` is replaced by one
that checks the figure's data, limits and texts and returns a small real PNG; the explicit tests
at the end render the real figure for the extreme inputs.
"""
from __future__ import annotations

import functools
import html
import math
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import ipywidgets as widgets
import pytest
import traitlets

from labkit import plots, validate
from labkit.comm import collective_time
from labkit.memory import estimate_memory
from labkit.widgets.comm import CUSTOM as COMM_CUSTOM, RANGES, CommCalculator
from labkit.widgets.memory import CUSTOM as MEM_CUSTOM, CUSTOM_FIELDS, MemoryCalculator

PROPERTY = settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INF, NAN = float("inf"), float("nan")
MAX_DIGITS = 20          # the most digits a number shown may have (9,999,999,999,999,999.99)
HUGE_TEXT = ["1e200", "1e308", "1e400", str(10**400), "9" * 30, "1" * 5000]
NOT_NUMBERS = ["", " ", "abc", "inf", "-inf", "nan", "NaN", "2.5", "1e3", "0x10", "1/2", "8 GPUs",
               "None", "--8", "١٢"]
# What a learner can type into a whole-number field: numbers in and around the ranges (powers of
# two make custom shapes that divide), 0, negative, huge, and text that is no whole number.
TYPED = st.one_of(
    st.integers(-3, 300).map(str),
    st.sampled_from([2**k for k in range(31)]).map(str),
    st.sampled_from(["0", "-1", "-4096", "1,024", "+8", " 16 ", "1_000"]),
    st.integers(10**6, 10**30).map(str),
    st.sampled_from(HUGE_TEXT + NOT_NUMBERS),
)
# What reaches a FloatText: in its front end, only numbers (it refuses other text itself); from
# Python, any float or int.
REALS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(1e-3, 1e5),
    st.sampled_from([0.0, -0.0, -1.0, 1e-300, 5e-324, 1e-7, 1e-6, INF, -INF, NAN, 1e200, 1e308,
                     *(v for _, low, high in RANGES.values() for v in (low, high)), 10**300]),
)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
NONSENSE = re.compile(r"\b(?:inf|infinity|nan)\b|∞", re.IGNORECASE)


# ---- what the figure may be ----------------------------------------------------------------
def _checked_png(fig) -> bytes:
    """Stand-in for png_bytes: every plotted value, axis limit and text of the figure is finite
    and readable; returns a real (small) PNG."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    for ax in fig.axes:
        assert all(math.isfinite(v) for v in (*ax.get_xlim(), *ax.get_ylim())), "axis limits"
        for artist in ax.get_children():
            if isinstance(artist, Line2D):
                data = [float(v) for xy in artist.get_xydata() for v in xy]
                assert all(math.isfinite(v) for v in data), f"line {artist.get_label()}"
            elif isinstance(artist, Rectangle) and artist is not ax.patch:
                corners = [artist.get_x(), artist.get_y(), artist.get_width(),
                           artist.get_height()]
                assert all(math.isfinite(float(v)) for v in corners), "bar"
    texts = [fig.get_suptitle()]     # not fig.findobj(): it builds every log-axis tick (slow)
    for ax in fig.axes:
        legend = ax.get_legend()
        texts += [ax.get_title()] + [t.get_text() for t in ax.texts]
        texts += [t.get_text() for t in legend.get_texts()] if legend else []
    for text in texts:
        _assert_readable(text, "figure text")
    return _small_png()


@functools.cache
def _small_png() -> bytes:
    fig = plots.new_figure(1.0, 1.0)
    fig.add_subplot().plot([0, 1], [0, 1])
    return plots.png_bytes(fig, dpi=10)


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.comm.png_bytes", _checked_png)
        mp.setattr("labkit.widgets.memory.png_bytes", _checked_png)
        yield


# ---- what the learner may see ----------------------------------------------------------------
def _text(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", value))


def _assert_readable(text: str, where: str) -> None:
    """No inf, nan or ∞, and every number finite with at most MAX_DIGITS digits."""
    assert not NONSENSE.search(text), f"{where}: {text!r}"
    for number in NUMBER.findall(text):
        mantissa = re.split(r"[eE]", number)[0]
        digits = sum(ch.isdigit() for ch in mantissa)
        assert digits <= MAX_DIGITS, f"{where}: {number} in {text!r}"
        assert math.isfinite(float(number.replace(",", ""))), f"{where}: {number}"


def _shows_one_state(result_html: str, figure, error: str | None) -> None:
    is_error = "labkit-error" in result_html
    assert is_error == (error is not None), (error, result_html[:300])
    if error is not None:
        assert "labkit-verdict" not in result_html and "Traceback" not in result_html
        assert figure.value == b"" and figure.layout.display == "none"
        assert len(error) < 1000, error[:300]
        # the message may quote what was typed ('inf', 'nan'), never a 300-digit number
        assert not re.search(r"\d{40}", error), error[:300]
    else:
        assert "labkit-verdict" in result_html
        assert bytes(figure.value).startswith(b"\x89PNG") and figure.layout.display != "none"
        _assert_readable(_text(result_html), "result")


def _raises_value_error(fn) -> bool:
    try:
        fn()
    except ValueError:
        return True
    return False


def check_comm(calc: CommCalculator) -> None:
    _shows_one_state(calc.result.value, calc.figure, calc.error)
    if calc.error is None:             # the result is the one the controls ask for, not stale
        assert calc.time == collective_time(**calc.inputs())
        assert math.isfinite(calc.time) and calc.time > 0
    else:
        assert calc.time is None
        assert _raises_value_error(lambda: collective_time(**calc.inputs()))


def check_memory(calc: MemoryCalculator) -> None:
    _shows_one_state(calc.verdict.value, calc.figure, calc.error)
    if calc.error is None:
        assert calc.estimate.total == estimate_memory(**calc.inputs()).total
        assert math.isfinite(calc.estimate.total) and calc.estimate.total > 0
        _assert_readable(_text(calc.breakdown.value), "breakdown")
    else:
        assert calc.estimate is None and calc.breakdown.value == ""
        assert _raises_value_error(lambda: estimate_memory(**calc.inputs()))
    _assert_readable(_text(calc.note.value), "note")


# ---- driving the controls ----------------------------------------------------------------
def _values_for(w) -> st.SearchStrategy:
    """What a control can be set to: a whole-number field any text, a FloatText any number or
    text (it casts '1e3' and 'inf' to floats and refuses 'abc'), a selection mostly one of its
    options (its front end offers nothing else) and sometimes None or a value it does not offer
    (from a notebook cell), a checkbox a bool."""
    if isinstance(w, widgets.Text):
        return TYPED
    if isinstance(w, widgets.FloatText):
        return st.one_of(REALS, st.sampled_from(HUGE_TEXT + NOT_NUMBERS))
    if isinstance(w, widgets.Checkbox):
        return st.booleans()
    options = st.sampled_from([o[1] if isinstance(o, tuple) else o for o in w.options])
    return st.one_of(options, options, options, st.sampled_from([None, -1, 3, "nope", NAN]))


def _assign(w, value) -> None:
    """Set a control as a test does. A FloatText refuses what is no float ('abc', 10**400), a
    selection None or what it does not offer, with traitlets' TraitError before any calculator
    sees it, and keeps its value (in the browser the front end offers nothing else, or puts the
    old value back); everything else reaches the calculator."""
    before = w.value
    try:
        w.value = value
    except traitlets.TraitError:
        assert isinstance(w, widgets.FloatText) or hasattr(w, "options"), (w.description, value)
        assert w.value == before or (math.isnan(w.value) and math.isnan(before))


def type_into(calc, **values) -> None:
    """What a learner does: type into a text field (so the value is text), or pick."""
    for name, value in values.items():
        w = calc.controls[name]
        w.value = str(value) if isinstance(w, widgets.Text) else value


def start_or_name_the_control(data, cls, controls, check) -> None:
    """A calculator started with any value of any one control either works (`check` passes) or
    refuses with a short message that starts with the control's name."""
    name = data.draw(st.sampled_from(controls), label="control")
    value = data.draw(ANYTHING, label=name)
    try:
        calc = cls(**{name: value})
    except ValueError as exc:
        assert str(exc).startswith(f"{name}=") and len(str(exc)) < 400, str(exc)[:300]
        return
    check(calc)


def drive(data, calc, check, weights: dict) -> None:
    """Change 1 to 8 controls (names drawn by weight), checking the calculator after each."""
    check(calc)
    names = [n for n, k in weights.items() for _ in range(k)]
    for _ in range(data.draw(st.integers(1, 8), label="changes")):
        name = data.draw(st.sampled_from(names), label="control")
        w = calc.controls[name]
        _assign(w, data.draw(_values_for(w), label=name))
        check(calc)


@PROPERTY
@given(data=st.data())
def test_comm_calculator_shows_a_result_or_a_message(data):
    calc = CommCalculator(link=data.draw(st.sampled_from(["nvlink4", "ib-ndr", COMM_CUSTOM])))
    drive(data, calc, check_comm, {"op": 1, "algorithm": 1, "size_mb": 3, "ranks": 3, "link": 1,
                                   "bandwidth_gbs": 3, "latency_us": 3})


@PROPERTY
@given(data=st.data())
def test_memory_calculator_shows_a_result_or_a_message(data):
    calc = MemoryCalculator(model=data.draw(st.sampled_from(["llama2-7b", "gpt2", MEM_CUSTOM])))
    weights = {name: 1 for name in calc.controls}
    weights.update({name: 3 for name in ("batch_size", "microbatches", "dp", *CUSTOM_FIELDS)})
    drive(data, calc, check_memory, weights)


# Anything a notebook cell may pass as a starting value.
ANYTHING = st.one_of(TYPED, REALS, st.sampled_from([None, True, False, 10**400, -(10**400), [8],
                                                    "custom", "all_reduce", "fp32"]))


@settings(PROPERTY, max_examples=60)
@given(data=st.data(), which=st.sampled_from([CommCalculator, MemoryCalculator]))
def test_a_starting_value_gives_a_calculator_or_a_message_naming_the_control(data, which):
    """MemoryCalculator(dp=...), CommCalculator(size_mb=...): any value builds a calculator
    that passes the checks above, or raises a short ValueError naming the control."""
    names = list(which().controls)
    name = data.draw(st.sampled_from(names), label="control")
    value = data.draw(ANYTHING, label=name)
    try:
        calc = which(**{name: value})
    except ValueError as exc:
        message = str(exc)
        assert len(message) < 400 and not re.search(r"\d{40}", message), message[:300]
        assert message.startswith(f"{name}="), message
        return
    (check_comm if which is CommCalculator else check_memory)(calc)


# ---- the cases the fault-injection runs found, and those the properties above found ----------
def _result_text(calc) -> str:
    return _text(calc.result.value if isinstance(calc, CommCalculator) else calc.verdict.value)


@pytest.mark.parametrize("order", [("bandwidth_gbs", "latency_us"), ("latency_us", "bandwidth_gbs")])
def test_custom_link_of_infinite_bandwidth_and_no_latency_is_a_message(order):
    """ZeroDivisionError escaped (the latency term over the bandwidth term was 0/0)."""
    calc = CommCalculator(link=COMM_CUSTOM)
    for name in order:
        calc.controls[name].value = {"bandwidth_gbs": INF, "latency_us": 0.0}[name]
        check_comm(calc)
    assert calc.error.startswith("custom bandwidth (GB/s per direction)=inf must be a number")
    assert CommCalculator(link=COMM_CUSTOM, bandwidth_gbs=INF, latency_us=0.0).error == calc.error


@pytest.mark.parametrize("hidden", ["1e200", str(10**200), 10**200, "1" * 5000])
def test_a_huge_hidden_size_is_a_message(hidden):
    """OverflowError escaped (integer division result too large for a float) for hidden=1e200;
    a 5,000-digit number got int()'s message about sys.set_int_max_str_digits."""
    calc = MemoryCalculator(model=MEM_CUSTOM, hidden=hidden)
    check_memory(calc)
    assert calc.error.startswith(("hidden=", "hidden_size=")), calc.error
    calc.controls["hidden"].value = "4096"
    check_memory(calc)
    assert calc.error is None


@pytest.mark.parametrize("size_mb", [INF, 1e300, NAN])
def test_an_infinite_message_size_is_a_message_not_inf_seconds(size_mb):
    """It showed 'inf GB ... inf s ... the latency term is nan% of it'."""
    calc = CommCalculator(size_mb=size_mb)
    check_comm(calc)
    assert calc.error.startswith("message size S (MB)=") and "inf s" not in calc.result.value


@pytest.mark.parametrize("values, start", [
    # 3.8e-29 GB/s showed 46,397,443,980,532,686,336,525,598,720.000 s
    ({"link": COMM_CUSTOM, "bandwidth_gbs": 3.8e-29}, "custom bandwidth (GB/s per direction)="),
    # less than a byte showed "all_reduce of 0 B"
    ({"size_mb": 5e-324}, "message size S (MB)=5e-324 must be a number >= 1e-06"),
])
def test_absurdly_small_values_are_messages(values, start):
    calc = CommCalculator(**values)
    check_comm(calc)
    assert calc.error.startswith(start), calc.error


def test_times_read_in_a_unit_that_fits():
    """No latency: no 'the two terms are equal at S = 0 B'; 20 days in days; 1e-15 s not as
    '0.0 µs'."""
    calc = CommCalculator(link=COMM_CUSTOM, latency_us=0.0)
    check_comm(calc)
    assert "0 B" not in _result_text(calc) and "every size is bandwidth-bound" in _result_text(calc)
    calc.controls["bandwidth_gbs"].value = 1e-3
    calc.controls["size_mb"].value = 1e6          # 1.75e6 s
    check_comm(calc)
    assert "(20.3 days)" in _result_text(calc)
    calc.controls["bandwidth_gbs"].value = 1e6
    calc.controls["size_mb"].value = 1e-6         # one byte over 1 PB/s: 1.75e-15 s
    check_comm(calc)
    assert "1.75e-15 s" in _result_text(calc) and "0.0 µs" not in _result_text(calc)


@pytest.mark.parametrize("which, values", [
    (CommCalculator, {"size_mb": "abc"}), (CommCalculator, {"latency_us": 10**400}),
    (CommCalculator, {"link": None}), (CommCalculator, {"op": "x" * 5000}),
    (MemoryCalculator, {"sequence_parallel": "yes"}), (MemoryCalculator, {"gpu": None}),
    (MemoryCalculator, {"pp": 10**400}), (MemoryCalculator, {"tp": 10**400}),
])
def test_a_starting_value_a_control_cannot_hold_is_a_short_message(which, values):
    """AttributeError ('FloatText' object has no attribute 'options') and KeyError (None)
    escaped; pp=10**400 was quoted with its 401 digits."""
    (name, _), = values.items()
    with pytest.raises(ValueError) as exc:
        which(**values)
    assert str(exc.value).startswith(f"{name}=") and len(str(exc.value)) < 200, str(exc.value)


def test_a_selection_refuses_none_and_keeps_its_value():
    calc = CommCalculator()
    with pytest.raises(traitlets.TraitError):
        calc.controls["link"].value = None
    assert calc.controls["link"].value == "nvlink4"
    check_comm(calc)


@pytest.mark.parametrize("op", ["all_reduce", "send_recv"])
@pytest.mark.parametrize("ranks, bandwidth, latency", [
    (2, 1e6, 0.0), (10**7, 1e15, 1e3), (10**6, 1e15, 1.0), (8, 1.0, 1e-6)])
def test_the_figure_at_the_extremes_is_a_png_of_finite_data(op, ranks, bandwidth, latency):
    from labkit.plots.comm import crossover_bytes, time_vs_size_figure

    fig = time_vs_size_figure(op, ranks, bandwidth, latency, mark=float(validate.MAX_BYTES))
    _checked_png(fig)
    assert plots.png_bytes(fig, dpi=30).startswith(b"\x89PNG")
    # the crossover is the latency term over the bytes-per-second term: n alpha B for a ring
    # all_reduce (2(n-1) alpha / (2(n-1)/n / B)), alpha B for send_recv; computed as a
    # difference of two times it was inf at 1e7 ranks and 1e3 s, and 0.08% off at 1e6 and 1 s
    want = (ranks if op == "all_reduce" else 1) * latency * bandwidth
    assert crossover_bytes(op, ranks, bandwidth, latency) == pytest.approx(want, rel=1e-9)


def test_mfu_is_typed_in_percent_in_every_calculator():
    """The DDP calculator offered MFU as a percent, the TP and planner calculators as a share
    (0.5): every one now takes the percent, labelled and checked alike."""
    from labkit.widgets import MFU_RANGE
    from labkit.widgets.ddp import DDPCalculator
    from labkit.widgets.planner import PlannerCalculator
    from labkit.widgets.tp import TPCalculator

    for cls, start in ((DDPCalculator, {"compute": "flops"}), (TPCalculator, {}),
                       (PlannerCalculator, {"gpus": 8, "model": "llama2-7b"})):
        calc = cls(**start)
        field = calc.controls["mfu"]
        assert field.description == MFU_RANGE[0] == "MFU (%)" and calc.ranges["mfu"] == MFU_RANGE
        assert 1 <= field.value <= 100, (cls.__name__, field.value)
        field.value = 0.4                                   # a share where a percent belongs
        assert calc.error.startswith("MFU (%)=0.4 must be a number >= 1 and <= 100"), calc.error


def test_a_cost_model_argument_is_shown_as_its_field_is_labelled():
    from labkit.widgets import labelled

    labels = {"batch_size": "sequences/GPU", "seq_len": "seq length", "stages": "stages p"}
    assert labelled("batch_size=0 must be a whole number >= 1", labels) == \
        "sequences/GPU=0 must be a whole number >= 1"
    assert labelled("tp=8 does not divide seq_len=100", labels) == \
        "tp=8 does not divide seq length=100"
    assert labelled("micro_batch_size=3; num_stages=2", labels) == \
        "micro_batch_size=3; num_stages=2"                  # only whole argument names
