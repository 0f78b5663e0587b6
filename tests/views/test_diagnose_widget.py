"""Module 09's diagnosis widget driven from plain pytest (no kernel, no lab run), with a fake case:
before an answer no widget holds any option's explanation (nothing the browser is sent); Check
or Enter shows the case's check message for the option given, then the explanation; no answer
or a letter that is not offered is asked again; a second answer does not replace the first."""
from __future__ import annotations

import html
import json
import re

import ipywidgets as widgets
import pytest

from labkit.widgets.diagnose import DiagnosisWidget

RIGHT = 2                                       # (c)
OPTIONS = ["Rank 1 is a straggler", "The network got slower", "Too many small all-reduces",
           "Every rank's compute got slower"]
# what only the explanations say: none of it may reach the browser before the answer
WHY = [f"SECRET-WHY-{x}: {w} <measured 12.5 ms & more>" for x, w in
       zip("abcd", ("no rank waits", "same bytes", "36 calls per step", "forward unchanged"))]
READING = "READING-SECRET: rank 0 waits 120 ms"


class FakeCase:
    """What DiagnosisWidget uses of labkit.labs.diagnose's Case: question, options, check."""

    def __init__(self, right: int = RIGHT):
        self.question = "Why are ALL ranks slow? (step times in the evidence)"
        self.options = list(OPTIONS)
        self.right = right
        self.checked: list[str] = []

    def check(self, answer):
        i = "abcd".index(answer)            # the widget passes a bare lower-case letter
        self.checked.append(answer)
        ok = i == self.right
        return ok, f"{'Right' if ok else 'Not'}: ({answer}) {WHY[i]}"


def tree(w):
    """The widget and every widget inside it."""
    yield w
    for child in getattr(w, "children", ()):
        yield from tree(child)


def sent(ask: DiagnosisWidget) -> str:
    """Everything the front end is sent: every widget's synced state, as one text."""
    return "\n".join(json.dumps(w.get_state(), default=str) for w in tree(ask.widget))


def text(value: str) -> str:
    """HTML as it reads: tags dropped, entities decoded, whitespace squeezed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", value)).split())


def secrets_in(ask) -> list[str]:
    shown = sent(ask)
    raw = text(shown.replace("\\n", " "))
    keys = [w.split(":")[0] for w in WHY] + ["READING-SECRET", "12.5 ms"]
    return [k for k in keys if k in shown or k in raw]


def test_before_an_answer_nothing_explains_any_option():
    case = FakeCase()
    ask = DiagnosisWidget(case, reading=READING)
    assert ask.state == "asking" and ask.given is None and ask.correct is None
    assert secrets_in(ask) == []
    assert ask.feedback.value == "" and ask.explanation.value == "" and ask.message.value == ""
    # the question and every option's text are shown, the options lettered a-d
    shown = text(ask.question_html.value)
    assert case.question in shown and all(o in shown for o in OPTIONS)
    assert [v for _, v in ask.choice.options] == ["a", "b", "c", "d"] and ask.choice.value is None
    assert case.checked == [], "the case was asked for an explanation before any answer"
    assert not ask.check.disabled and not ask.choice.disabled and not ask.typed.disabled
    # displayed as a widget (the cell's last value)
    assert "application/vnd.jupyter.widget-view+json" in ask._repr_mimebundle_()


def test_the_right_option_and_check_shows_the_right_message_then_the_explanation():
    case = FakeCase()
    ask = DiagnosisWidget(case, reading=READING)
    ask.choice.value = "c"
    ask.check.click()
    ok, message = FakeCase().check("c")
    assert ok and ask.state == "answered" and ask.given == "c" and ask.correct is True
    assert ask.result == (ok, message)
    assert message in text(ask.feedback.value) and "Right" in text(ask.feedback.value)
    explained = text(ask.explanation.value)
    assert READING in explained
    assert all(w in explained for w in WHY), "every option's reason is shown once answered"
    assert "supports" not in explained            # no correction needed
    assert ask.check.disabled and ask.choice.disabled and ask.typed.disabled


def test_a_wrong_option_shows_its_message_and_which_option_the_evidence_supports():
    ask = DiagnosisWidget(FakeCase(), reading=READING)
    ask.choice.value = "a"
    ask.check.click()
    ok, message = FakeCase().check("a")
    assert not ok and ask.correct is False and ask.given == "a"
    feedback = text(ask.feedback.value)
    assert message in feedback and feedback.count("SECRET-WHY") == 1     # the chosen one's only
    explained = text(ask.explanation.value)
    assert "The evidence supports (c)" in explained and WHY[RIGHT] in explained
    assert READING in explained


@pytest.mark.parametrize("typed", ["c", "C", "(c)", " c "])
def test_a_letter_typed_and_enter_answers(typed):
    ask = DiagnosisWidget(FakeCase())
    ask.typed.value = typed                      # the box sends its value on Enter
    assert ask.state == "answered" and ask.given == "c" and ask.correct is True
    assert ask.choice.value == "c"               # the option answered is shown picked
    assert WHY[RIGHT] in text(ask.feedback.value)


def test_no_answer_or_a_letter_not_offered_is_asked_again_and_reveals_nothing():
    case = FakeCase()
    ask = DiagnosisWidget(case, reading=READING)
    ask.check.click()                            # nothing picked, nothing typed
    assert ask.state == "asking" and "No answer yet" in text(ask.message.value)
    for bad in ("z", "e", "ab", "1"):
        ask.typed.value = bad
        assert ask.state == "asking", bad
        assert f"'{bad}' is not one of the options" in text(ask.message.value), bad
        assert "a, b, c, d" in text(ask.message.value)
        assert ask.typed.value == ""             # cleared: the same text typed again is sent
    assert ask.answer("") is None and ask.answer(None) is None and ask.state == "asking"
    assert secrets_in(ask) == [] and case.checked == []
    assert ask.feedback.value == "" and ask.explanation.value == ""
    ask.typed.value = "b"                        # then a real answer is taken
    assert ask.state == "answered" and ask.given == "b" and ask.message.value == ""


def test_answering_twice_keeps_the_first_answer():
    case = FakeCase()
    ask = DiagnosisWidget(case, reading=READING)
    ask.choice.value = "c"
    ask.check.click()
    first = (ask.feedback.value, ask.explanation.value, ask.result)
    ask.check.click()                            # a double click: the same answer, no note
    assert ask.answer("(C)") == first[2]
    assert ask.repeats == 0 and ask.message.value == "" and case.checked.count("c") == 2
    ask.choice.value = "a"                       # a change of mind, checked
    ask.check.click()
    ask.typed.value = "b"                        # or typed
    assert ask.answer("d") == first[2]
    assert (ask.feedback.value, ask.explanation.value, ask.result) == first
    assert ask.given == "c" and ask.correct is True and ask.repeats == 3
    assert "Already answered: your answer (c) stands" in text(ask.message.value)
    assert case.checked.count("a") == 1          # asked once, for the explanation: not scored


def test_a_letter_typed_then_check_is_one_answer():
    """In the browser the box sends what was typed when it loses focus to the Check button:
    the answer is taken then, and the click that follows is the same answer, not a second."""
    ask = DiagnosisWidget(FakeCase())
    ask.typed.value = "a"                        # sent on blur
    ask.check.click()                            # then the click
    assert ask.given == "a" and ask.repeats == 0 and ask.message.value == ""
    assert "Not: (a)" in text(ask.feedback.value)

    wrong = DiagnosisWidget(FakeCase())          # a wrong first answer is not fixed by a second
    wrong.answer("b")
    wrong.answer("c")
    assert wrong.given == "b" and wrong.correct is False and wrong.result[0] is False
    assert "Not: (b)" in text(wrong.feedback.value)


def test_the_reading_is_held_until_the_answer_and_read_lazily():
    calls = []

    def reading():
        calls.append(1)
        return READING

    ask = DiagnosisWidget(FakeCase())
    ask.explain(reading)                         # the lesson's reading cell runs before an answer
    assert calls == [] and secrets_in(ask) == []
    ask.answer("c")
    assert calls and READING in text(ask.explanation.value)
    later = DiagnosisWidget(FakeCase())
    later.answer("a")
    assert READING not in text(later.explanation.value)
    later.explain("READING-SECRET: late")        # answered already: shown at once
    assert "READING-SECRET: late" in text(later.explanation.value)


def test_the_real_case_class_works_with_the_widget():
    """labkit.labs.diagnose's Case (built by hand here: no lab runs) has what the widget uses."""
    from labkit.labs.diagnose.lab import Case

    case = Case(name="slow-steps", title="t", question="Why?", options=["x", "y", "z"],
                answer=1, why=["No: SECRET-X", "Yes: SECRET-Y", "No: SECRET-Z"], evidence={})
    ask = DiagnosisWidget(case)
    assert "SECRET" not in sent(ask)
    ask.choice.value = "b"
    ask.check.click()
    assert ask.correct is True and "Right: (b) Yes: SECRET-Y" in text(ask.feedback.value)
    assert "SECRET-X" in text(ask.explanation.value)


def test_a_case_needs_two_options_or_more():
    case = FakeCase()
    case.options = ["only one"]
    with pytest.raises(ValueError, match="2 to 26 options"):
        DiagnosisWidget(case)


def test_every_control_is_a_widget_in_the_tree_and_marked_for_the_browser_test():
    ask = DiagnosisWidget(FakeCase())
    inside = list(tree(ask.widget))
    for w in (ask.question_html, ask.choice, ask.typed, ask.check, ask.message, ask.feedback,
              ask.explanation):
        assert any(w is x for x in inside) and isinstance(w, widgets.Widget)
    for name in ("choice", "typed", "check"):
        assert f"labkit-control-{name}" in getattr(ask, name)._dom_classes
