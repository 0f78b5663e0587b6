"""A "diagnose this run" case answered before it is explained (module 09): the question and its
lettered options; an answer (an option and Check, or its letter typed and Enter); then the case's
check message for it, the option the evidence supports, every option's reason, the lesson's reading.

    >>> ask = DiagnosisWidget(case)        # a built case: labkit.labs.diagnose.build(...)
    >>> ask.choice.value = "b"; ask.check.click()     # or ask.typed.value = "b" (Enter)
    >>> ask.explain("rank 1 waits least ...")         # the lesson's reading, shown once answered

Before the answer no widget value holds an explanation: they are asked of the case
(`case.check(letter)`) when the learner answers. Any object with .question, .options and
.check(letter) -> (ok, message) will do; this module never imports labkit.labs.
"""
from __future__ import annotations

import string

import ipywidgets as widgets

from labkit.widgets import row
from labkit.widgets.quiz import esc

RIGHT, WRONG, ASK = "#1b5e20", "#b00020", "#8a5a00"


class DiagnosisWidget:
    """question_html (the question and the options' text), choice (lettered RadioButtons, value
    None until picked), typed (Text: a letter, sent with Enter), check (Button), message (why an
    answer was not taken, or that the first answer stands), feedback (the case's check message),
    explanation (the right option, the reading, every option's reason); `widget` holds them.

    state: "asking" until an answer is taken, then "answered". `given` is the letter answered,
    `correct` whether it was right, `result` the (ok, message) of case.check; `repeats` counts
    other answers given after the first (each refused with a note: the first answer stands). No
    answer or a letter that is not offered gets a message and the question stays open."""

    def __init__(self, case, reading=None):
        self.case = case
        self.options = [str(o) for o in case.options]
        if not 2 <= len(self.options) <= len(string.ascii_lowercase):
            raise ValueError(f"a case needs 2 to 26 options; this one has {len(self.options)}")
        self.letters = list(string.ascii_lowercase[:len(self.options)])
        self.reading = reading
        self.question_html = widgets.HTML(self._question())
        # lettered buttons; the options' text is in question_html, where long lines wrap
        self.choice = widgets.RadioButtons(options=[(f"({x})", x) for x in self.letters],
                                           value=None, orientation="horizontal",
                                           description="answer",
                                           layout=widgets.Layout(width="auto"))
        # sends its value on Enter (continuous_update=False): a letter typed is an answer
        self.typed = widgets.Text(description="or type", placeholder="a letter, then Enter",
                                  continuous_update=False, style={"description_width": "60px"},
                                  layout=widgets.Layout(width="220px"))
        self.check = widgets.Button(description="Check", button_style="primary",
                                    tooltip="check the option picked")
        self.message = widgets.HTML()
        self.feedback = widgets.HTML()
        self.explanation = widgets.HTML()
        self.state = "asking"
        self.given: str | None = None
        self.correct: bool | None = None
        self.result: tuple | None = None
        self.repeats = 0
        self.widget = widgets.VBox([self.question_html,
                                    row([self.choice, self.typed, self.check]),
                                    self.message, self.feedback, self.explanation])
        self.widget.add_class("labkit-diagnosis")
        for name, w in (("choice", self.choice), ("typed", self.typed), ("check", self.check)):
            w.add_class("labkit-control")
            w.add_class(f"labkit-control-{name}")
        self.check.on_click(lambda _: self._on_check())
        self.typed.observe(self._on_typed, names="value")

    # ---- answering --------------------------------------------------------------------------
    def answer(self, given) -> tuple | None:
        """Take `given` (a letter: "b", "B", "(b)") as the answer: (ok, message) from the case,
        shown with the explanation. None when it is no option (a message; still asking). Once
        answered, a further answer changes nothing and returns the first (ok, message); a
        different one also gets a note that the first one stands."""
        key = str(given if given is not None else "").strip().strip("()").strip().lower()
        if self.state == "answered":
            # the same answer again (a double click; a letter typed, sent as the box loses
            # focus to Check, then Check) changes nothing; another one is refused with a note
            if key != self.given:
                self.repeats += 1
                self.message.value = _note(
                    ASK, f"Already answered: your answer ({self.given}) stands; the "
                         "explanation is below.")
            return self.result
        if not key:
            self.message.value = _note(
                ASK, f"No answer yet: pick an option ({self._allowed()}) and Check, or type "
                     "its letter and press Enter.")
            return None
        if key not in self.letters:
            self.typed.value = ""                 # so the same text typed again is sent again
            self.message.value = _note(
                WRONG, f"{str(given).strip()!r} is not one of the options; answer with a "
                       f"letter: {self._allowed()}.")
            return None
        ok, text = self.case.check(key)
        self.state, self.given, self.correct, self.result = "answered", key, bool(ok), (ok, text)
        self.message.value = ""
        self.choice.value = key
        colour, cls = (RIGHT, "right") if ok else (WRONG, "wrong")
        self.feedback.value = (f'<div class="labkit-diagnosis-{cls}" style="color:{colour}">'
                               f"<b>Your answer ({key})</b> · {esc(text)}</div>")
        self.choice.disabled = self.typed.disabled = self.check.disabled = True
        self._explain()
        return self.result

    def explain(self, reading) -> None:
        """Set the lesson's reading of the evidence (text, or a function returning it): held
        here, shown only once the case is answered (at once if it already is)."""
        self.reading = reading
        if self.state == "answered":
            self._explain()

    def _on_check(self) -> None:
        """Check: the option picked, else the letter typed."""
        self.answer(self.choice.value if self.choice.value is not None else self.typed.value)

    def _on_typed(self, change) -> None:
        """Enter in the letter box: its text is an answer (an emptied box is none)."""
        if str(change["new"]).strip():
            self.answer(change["new"])

    # ---- what is shown ----------------------------------------------------------------------
    def _allowed(self) -> str:
        return ", ".join(self.letters)

    def _question(self) -> str:
        return ('<div class="labkit-diagnosis-question">'
                f"<p><b>{esc(self.case.question)}</b></p><ol type='a'>"
                + "".join(f"<li>{esc(o)}</li>" for o in self.options) + "</ol></div>")

    def _explain(self) -> None:
        """The explanation, asked of the case now: which option the evidence supports, the
        lesson's reading, and every option's reason."""
        checks = [(x, *self.case.check(x)) for x in self.letters]
        right = [x for x, ok, _ in checks if ok]
        parts = []
        if right and not self.correct:
            parts.append(f"<p>The evidence supports <b>({', '.join(right)})</b>.</p>")
        reading = self.reading() if callable(self.reading) else self.reading
        if reading:
            parts.append("<p><b>Reading the evidence</b></p>"
                         '<div class="labkit-diagnosis-reading" style="font-family:monospace;'
                         f'white-space:pre-wrap">{esc(reading)}</div>')
        parts.append("<p><b>Every option</b></p><ul>"
                     + "".join(f"<li>{esc(text)}</li>" for _, _, text in checks) + "</ul>")
        self.explanation.value = ('<div class="labkit-diagnosis-explanation">' + "".join(parts)
                                  + "</div>")

    def _repr_mimebundle_(self, **kwargs):
        """The last line `ask` of a cell displays the widget."""
        return self.widget._repr_mimebundle_(**kwargs)


def _note(colour: str, text: str) -> str:
    return f'<div class="labkit-diagnosis-note" style="color:{colour}">{esc(text)}</div>'
