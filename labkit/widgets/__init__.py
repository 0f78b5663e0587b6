"""Calculators (layer 2: views). A calculator is a thin view over the pure cost models: it holds
no formula of its own, keeps its results in widget traits (`HTML.value`, `Image.value`, never
printed into an Output), shows bad input as a message in the widget (never a traceback, and no
figure rather than a broken image), and can be driven from a test by setting its controls'
`.value`. Whole numbers are typed into `int_field`s (text: '2.5' gets a message, not 25) or
picked from the values that work (dropdowns, toggle buttons); controls sit in wrapping rows of
fixed widths, so every one stays visible and clickable in a 1280-px-wide JupyterLab.

May import: layer 1 (cost models), plots/ and ipywidgets. Never runtime/, parallel/, labs/,
course/, cli/.
"""
from __future__ import annotations

import html
import re

import ipywidgets as widgets
import traitlets

from labkit import validate

# Digits a typed whole number may have: int() refuses more than 4,300 (with a message about
# sys.set_int_max_str_digits); below that the cost models name the argument and its range.
MAX_DIGITS = 4000
# MFU is typed in percent in every calculator (the figures and the papers quote it so); below
# 1 % is no training run, and refusing it catches a share (0.4) typed where a percent belongs.
MFU_RANGE = ("MFU (%)", 1.0, 100.0)


def error_html(exc: Exception | str) -> str:
    """The message a calculator shows instead of a result when its input is invalid (one line
    per problem when it lists several)."""
    text = "<br>".join(html.escape(line) for line in str(exc).splitlines())
    return (f'<div class="labkit-error" style="color:#b00020"><b>Cannot compute:</b> '
            f"{text}</div>")


def labelled(message: str, labels: dict[str, str]) -> str:
    """`message` with each argument it names written as the field is labelled: the cost models
    name their arguments ('batch_size=0 must be ...'), a learner sees the labels
    ('sequences/GPU=0 must be ...'). `labels`: argument name -> label."""
    if not labels:
        return message
    names = "|".join(re.escape(n) for n in sorted(labels, key=len, reverse=True))
    return re.sub(rf"(?<![\w.\-])({names})=", lambda m: f"{labels[m.group(1)]}=", message)


def table_html(rows, header=None) -> str:
    """A small HTML table from rows of cells (strings or numbers) under an optional header of
    labels. Refused with a ValueError: a row that is a string (the header passed first, as in
    `table_html(["a", "b"], rows)`, renders one letter per cell), a header that is not a sequence
    of labels (str or numbers), a row wider than the header. A shorter row ends in empty cells."""
    signature = "the signature is table_html(rows, header=None)"
    if isinstance(rows, (str, bytes)):
        raise ValueError(f"table_html: rows is a string ({rows!r}); allowed: a list of rows, each "
                         f"a list of cells; {signature}")
    rows = list(rows)
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise ValueError(f"table_html: row {i} is {row!r}, not a sequence of cells (a string "
                             f"would show one letter per cell); was the header passed first? "
                             f"{signature}")
    width = None
    if header is not None:
        if isinstance(header, (str, bytes)) or not hasattr(header, "__iter__"):
            raise ValueError(f"table_html: header={header!r} is not a sequence of labels; "
                             f"allowed: a list or tuple of str (or numbers), or None")
        header = list(header)
        bad = [h for h in header if isinstance(h, bool) or not isinstance(h, (str, int, float))]
        if bad:
            raise ValueError(f"table_html: header holds {bad[0]!r}, not a label; allowed: str "
                             f"or numbers (rows passed as the header? {signature})")
        width = len(header)
    rows = [list(row) for row in rows]
    for i, row in enumerate(rows):
        if width is not None and len(row) > width:
            raise ValueError(f"table_html: row {i} has {len(row)} cells, the header {width} "
                             f"labels; allowed: at most {width} cells a row")
    out = ['<table class="labkit-table">']
    if header:
        out.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        row = row + [""] * ((width or len(row)) - len(row))
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def int_field(description: str, value: int, width: str = "250px",
              description_width: str = "100px") -> widgets.Text:
    """A text field for a whole number, read with `whole_number`. Not `IntText`: its front end
    deletes '.', 'e' and ',' as they are typed (ipywidgets 8), so '2.5' reached the kernel as 25
    and '1e3' as 13; a Text field passes on what was typed, and a mistake gets a message."""
    return widgets.Text(value=str(value), description=description, continuous_update=False,
                        style={"description_width": description_width},
                        layout=widgets.Layout(width=width))


def whole_number(name: str, text: str) -> int:
    """The whole number typed into a field called `name`: digits, optionally signed and grouped
    with ',' or '_' ('1,024'); anything else ('2.5', '1e3', '') is a ValueError naming the field.
    Ranges are the cost models' to check (they name the argument and its limits); only a number
    of more than MAX_DIGITS digits is refused here."""
    text = str(text)
    digits = re.sub(r"[,_]", "", text.strip())
    typed = f"{name}={validate.describe(text)}"
    if not re.fullmatch(r"[+-]?\d+", digits):
        raise ValueError(f"{typed} is not a whole number; type digits only (e.g. 8 or 1024)")
    count = len(digits.lstrip("+-"))
    if count > MAX_DIGITS:
        raise ValueError(f"{typed} has {count:,} digits; no field takes a number that large "
                         "(e.g. 8 or 1024)")
    return int(digits)


class _NotNone(traitlets.Any):
    allow_none = False           # traitlets skips the validators for None when it is allowed


class _Chosen(traitlets.HasTraits):
    """A selection that always holds one of its options: None ("nothing selected", which no
    browser sends but a notebook cell can) is refused with a TraitError, as a value that is not
    offered is, instead of reaching the calculator as a selected value."""

    value = _NotNone(help="Selected value")

    @traitlets.validate("value")
    def _validate_value(self, proposal):
        if proposal.value is None:
            raise traitlets.TraitError("Invalid selection: nothing selected")
        return super()._validate_value(proposal)


class Dropdown(_Chosen, widgets.Dropdown):
    """A Dropdown that always holds one of its options (never None)."""


class ToggleButtons(_Chosen, widgets.ToggleButtons):
    """ToggleButtons that always hold one of their options (never None)."""


def row(children) -> widgets.HBox:
    """Controls side by side that wrap onto the next line when the output area is narrower than
    they are (each keeps its own fixed width), so none is pushed out of view or under another."""
    return widgets.HBox(children, layout=widgets.Layout(flex_flow="row wrap",
                                                        align_items="center", width="100%"))


def _option_values(w) -> list:
    return [o[1] if isinstance(o, tuple) else o for o in w.options]


def pick(description, options, value, width="250px", toggles=False):
    """A dropdown (or toggle buttons) of the calculators' standard width and label width."""
    kind = ToggleButtons if toggles else Dropdown
    w = kind(options=options, value=value, description=description,
             style={"description_width": "110px", **({"button_width": "80px"} if toggles else {})},
             layout=widgets.Layout(width=width))
    if toggles:
        w.add_class("widget-inline-hbox")
    return w


def mfu_field(value: float = 40.0):
    """MFU typed in percent (40 = 40 % of the GPU's dense peak), the same in every calculator;
    read it with `Calculator._mfu` (a share, 0.4) and put MFU_RANGE in `ranges` under "mfu"."""
    return float_field(MFU_RANGE[0], value)


def float_field(description, value, width="250px"):
    """A typed number field of the calculators' standard width (checked by Calculator._number)."""
    return widgets.FloatText(value=value, description=description, layout=widgets.Layout(
        width=width), style={"description_width": "110px"})


class Calculator:
    """What every calculator shares. A subclass builds `self.controls` (name -> widget), calls
    `self._set_initial(initial)`, builds its outputs and `self.widget`, then `self._watch()`;
    it implements `update()`, which reads the controls and refreshes the outputs."""

    controls: dict
    widget: object
    # number fields: name -> (label, lowest, highest), checked by `_number` and named by
    # `_not_offered` when a starting value is not a number
    ranges: dict = {}
    # cost-model argument -> the control it comes from, where their names differ (a typed
    # field's own name is its argument's): `error_text` writes either as the control's label
    arguments: dict = {}

    def _number(self, name: str) -> float:
        """The value of number field `name`, checked against its range (`ranges`)."""
        label, low, high = self.ranges[name]
        return validate.at_least(label, self.controls[name].value, low, high)

    def _mfu(self) -> float:
        """The MFU typed in percent, as the share of peak the cost models take (40 -> 0.4)."""
        return self._number("mfu") / 100

    def error_text(self, exc: Exception) -> str:
        """What the calculator shows for `exc`: its text with the arguments it names written as
        the fields are labelled (`labelled`)."""
        labels = {name: w.description for name, w in self.controls.items()
                  if isinstance(w, widgets.Text)}
        labels.update({arg: self.controls[name].description
                       for arg, name in self.arguments.items()})
        renamed = {arg: label for arg, label in labels.items() if arg != label}
        return labelled(str(exc), renamed)

    def _set_initial(self, initial: dict) -> None:
        """Starting values by control name; an unknown name is a ValueError listing the names."""
        unknown = set(initial) - set(self.controls)
        if unknown:
            raise ValueError(f"unknown control(s) {sorted(unknown)}; allowed: {', '.join(self.controls)}")
        for name, value in initial.items():
            w = self.controls[name]
            if isinstance(w, widgets.Text) and not isinstance(value, str):
                value = str(value)               # MemoryCalculator(dp=8): the field shows "8"
            try:
                w.value = value
            except traitlets.TraitError:         # not one of a selection's options
                raise ValueError(self._not_offered(name, value)) from None

    def _not_offered(self, name: str, value) -> str:
        """The message for a starting value the control cannot take: not among a selection's
        options, not a bool for a checkbox, not a float for a number field."""
        w, shown = self.controls[name], validate.describe(value)
        if name in self.ranges:
            label, low, high = self.ranges[name]
            return (f"{name}={shown} is not a float; allowed: a number from "
                    f"{validate.show(low)} to {validate.show(high)} ({label})")
        if isinstance(w, widgets.Checkbox):
            return f"{name}={shown} is not True or False; allowed: True, False"
        if not hasattr(w, "options"):
            return f"{name}={shown} is not a float; allowed: a number"
        allowed = ", ".join(repr(v) for v in _option_values(w))
        return f"{name}={shown} is not offered; allowed: {allowed}"

    def read_ints(self, names) -> dict[str, int]:
        """The whole numbers typed into the text fields `names` (by control name), or one
        ValueError naming every field that does not hold one, a line each."""
        values, bad = {}, []
        for name in names:
            w = self.controls[name]
            try:
                values[name] = whole_number(w.description, w.value)
            except ValueError as exc:
                bad.append(str(exc))
        if bad:
            raise ValueError("\n".join(bad))
        return values

    def show_figure(self, png: bytes | None, image=None) -> None:
        """Show the figure's PNG bytes in `image` (default: `self.figure`), or (None) hide the
        image: an Image with no bytes draws a broken-image icon in the browser."""
        image = self.figure if image is None else image
        # The browser applies each message as it comes: hide before emptying, fill before
        # showing, so no broken-image icon ever shows between the two.
        if png:
            image.value = png
            image.layout.display = ""
        else:
            image.layout.display = "none"
            image.value = b""

    def _watch(self) -> None:
        """Recompute whenever any control changes (observers fire synchronously on `.value`).
        Each control also gets the CSS classes `labkit-control` and `labkit-control-NAME`, by
        which the browser test finds every one."""
        for name, w in self.controls.items():
            w.observe(self._on_change, names="value")
            w.add_class("labkit-control")
            w.add_class(f"labkit-control-{name}")

    def _on_change(self, change) -> None:
        self.update()

    def update(self) -> None:  # pragma: no cover - every calculator defines it
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        """The last line `calc` of a cell displays the calculator."""
        return self.widget._repr_mimebundle_(**kwargs)
