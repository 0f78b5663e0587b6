"""Tier 4: a real browser. JupyterLab in headless Chromium renders the calculators as a learner
sees them: the memory calculator reacts to its controls; in custom-shape mode every control of
both calculators is visible and clickable in a 1280-px-wide window (and a 1920-px one); typing
'2.5' or '1e3' into a whole-number field gets a message, never 25 or 13; the error state shows
no broken image. Skipped where Chromium or playwright is not installed (.ci/run installs both).
One JupyterLab and one Chromium serve the whole module."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from lab_server import CHROMIUM, CHROMIUM_ARGS, require_browser, serving

from labkit.cli.course import lab_command

pytestmark = [pytest.mark.server, pytest.mark.slow]
TOKEN = "labkit-browser-test"
SCREENSHOT = Path(tempfile.gettempdir()) / "labkit-browser-test-failure.png"
NOTEBOOKS = {
    "calc.ipynb": "from labkit.widgets.memory import MemoryCalculator\n"
                  "calc = MemoryCalculator()\ncalc",
    # Every control of both calculators on screen: the custom shape and the custom link shown.
    "custom.ipynb": "from IPython.display import display\n"
                    "from labkit.widgets.comm import CommCalculator\n"
                    "from labkit.widgets.memory import MemoryCalculator\n"
                    "calc = MemoryCalculator(model='custom')\n"
                    "comm = CommCalculator(link='custom')\n"
                    "display(calc.widget, comm.widget)",
}


def _notebook(source: str) -> str:
    return json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "id": "calc", "metadata": {},
                   "outputs": [], "source": source}],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5})


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    require_browser()
    tmp_path = tmp_path_factory.mktemp("lab")
    root = tmp_path / "root"
    root.mkdir()
    for name, source in NOTEBOOKS.items():
        (root / name).write_text(_notebook(source))
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = {"JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    cmd = lab_command(port=0, token=TOKEN, open_browser=False, notebook="calc.ipynb")
    cmd = [f"--ServerApp.root_dir={root}" if a.startswith("--ServerApp.root_dir=") else a for a in cmd]
    with serving(cmd, root, tmp_path / "runtime", env) as info:
        yield f"http://127.0.0.1:{info['port']}"


@pytest.fixture(scope="module")
def browser(lab_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _open(browser, server, notebook, width, height):
    """A page on `notebook` with its one cell run (what a learner does: click, Shift+Enter)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser.new_page(viewport={"width": width, "height": height})
    # ?reset: a fresh workspace, so the tab of another test's notebook does not come back
    page.goto(f"{server}/lab/tree/{notebook}?reset&token={TOKEN}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    # Right after the page loads the kernel can report idle before its session accepts
    # requests, so a first Shift+Enter may be lost (the prompt stays "[ ]:"), or a kernel
    # dialog may pop up: try again (the cell has no side effects).
    prompt = page.locator(".jp-Cell .jp-InputPrompt").first
    for attempt in range(4):
        # Under load JupyterLab may ask which kernel to use: take the default (python3).
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():
            dialog.first.click()
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=60_000)
        page.locator(".jp-Cell .jp-InputArea-editor").first.click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function("(el) => el.innerText.trim() !== '[ ]:'",
                                   arg=prompt.element_handle(), timeout=5_000)
            page.locator(".labkit-verdict").first.wait_for(timeout=30_000)
            return page
        except PlaywrightTimeout:
            if attempt == 3:
                raise
    return page


@pytest.fixture
def screenshot_on_failure(request):
    """Call it with a page: if the test fails, what that page showed is saved for the report."""
    pages, failed_before = [], request.session.testsfailed
    yield pages.append
    if request.session.testsfailed > failed_before:     # the call phase has been reported
        for page in pages:
            page.screenshot(path=str(SCREENSHOT))
            print(f"screenshot of the failing page: {SCREENSHOT}")


def test_memory_calculator_renders_and_reacts(lab_server, browser, screenshot_on_failure):
    from playwright.sync_api import expect

    from labkit.memory import estimate_memory
    from labkit.models import PRESETS
    from labkit.plots import fmt_bytes, fmt_count

    page = _open(browser, lab_server, "calc.ipynb", 1400, 1000)
    screenshot_on_failure(page)
    verdict = page.locator(".labkit-verdict")
    assert "Does not fit" in verdict.inner_text()   # llama2-7b, no ZeRO, dp=1, 80 GB
    assert page.locator(".jp-OutputArea img").count() >= 1, "the stacked-bar figure is missing"
    # ZeRO-3 over 8 GPUs and full recomputation: Llama-2-7B now fits on one 80 GB GPU.
    page.locator(".labkit-control-zero_stage").get_by_role("button", name="3", exact=True).click()
    page.locator(".labkit-control-recompute").get_by_role("button", name="full",
                                                           exact=True).click()
    dp = page.locator(".labkit-control-dp input")
    dp.fill("8")
    dp.press("Enter")
    _wait_for_verdict(page, "Fits")
    # GPT-2 has 1024 learned positions: picking it moves the sequence length to 1024, and says so.
    model = page.locator(".labkit-control-model select")
    model.select_option(label=f"gpt2 ({fmt_count(PRESETS['gpt2'].num_params())} params)")
    seq = page.locator(".labkit-control-seq_len select")
    expect(seq.locator("option:checked")).to_have_text("1,024", timeout=30_000)
    expect(page.locator(".labkit-note")).to_contain_text("1,024 learned positions")
    expect(page.locator(".labkit-verdict")).to_contain_text("Fits", timeout=30_000)
    gpt2 = estimate_memory("gpt2", seq_len=1024, zero_stage=3, dp=8, recompute="full")
    expect(page.locator(".labkit-verdict")).to_contain_text(fmt_bytes(gpt2.total))
    # Bad input is a message in the widget, not a traceback.
    dp.fill("0")
    dp.press("Enter")
    page.wait_for_selector(".labkit-error", timeout=30_000)
    assert "dp=0" in page.locator(".labkit-error").inner_text()
    assert page.locator(".jp-OutputArea-output[data-mime-type*='error']").count() == 0
    page.close()


@pytest.fixture(scope="module")
def custom_page(lab_server, browser):
    """Both calculators, with every control shown, in a 1280 x 800 window."""
    page = _open(browser, lab_server, "custom.ipynb", 1280, 800)
    yield page
    page.close()


def _controls():
    """Every control of both calculators, by name (what `labkit-control-NAME` classes say)."""
    from labkit.widgets.comm import CommCalculator
    from labkit.widgets.memory import MemoryCalculator

    return {**MemoryCalculator(model="custom").controls, **CommCalculator(link="custom").controls}


# {control name: [problems]} for the controls that are not fully visible and clickable: for the
# control's element and each input/select/button inside it, once the notebook is scrolled to it:
# no size, not inside the window, or not the topmost element at its centre (covered by another,
# or clipped); and buttons (toggle buttons) that wrap onto a second line. Only the notebook
# scrolls, as a learner's mouse wheel does: scrollIntoView would also scroll a widget box whose
# content overflows it, and so find what the learner cannot.
HIDDEN_CONTROLS = """(names) => {
  const problems = {};
  for (const name of names) {
    const found = document.querySelectorAll('.labkit-control-' + name);
    if (found.length !== 1) { problems[name] = [found.length + ' elements']; continue; }
    const el = found[0], bad = [];
    const scroller = el.closest('.jp-WindowedPanel-outer');
    if (scroller) {
      const r = el.getBoundingClientRect(), s = scroller.getBoundingClientRect();
      scroller.scrollTop += (r.top + r.height / 2) - (s.top + s.height / 2);
    }
    for (const t of [el, ...el.querySelectorAll('input, select, button, textarea')]) {
      const r = t.getBoundingClientRect();
      const what = t === el ? 'control' : t.tagName.toLowerCase();
      if (r.width < 1 || r.height < 1) { bad.push(what + ' has no size'); continue; }
      if (r.left < 0 || r.top < 0 || r.right > window.innerWidth || r.bottom > window.innerHeight)
        bad.push(`${what} [${Math.round(r.left)}, ${Math.round(r.right)}] x `
                 + `[${Math.round(r.top)}, ${Math.round(r.bottom)}] is outside the window`);
      const top = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
      if (!top || !(t === top || t.contains(top)))
        bad.push(`${what} is under ${top ? top.tagName + '.' + top.className : 'nothing'}`);
    }
    const tops = new Set([...el.querySelectorAll('button')]
                         .map(b => b.getBoundingClientRect().top));
    if (tops.size > 1) bad.push(`its buttons wrap onto ${tops.size} lines`);
    if (bad.length) problems[name] = bad;
  }
  return problems;
}"""


def test_every_control_is_visible_and_clickable_at_1280_px(custom_page, screenshot_on_failure):
    page = custom_page
    screenshot_on_failure(page)
    names = list(_controls())
    for width, height in ((1280, 800), (1920, 1080)):
        page.set_viewport_size({"width": width, "height": height})
        page.wait_for_timeout(300)                     # let JupyterLab re-lay out
        assert page.evaluate(HIDDEN_CONTROLS, names) == {}, f"at {width} x {height} px"
    page.set_viewport_size({"width": 1280, "height": 800})


def test_error_state_shows_no_broken_image(custom_page, screenshot_on_failure):
    page = custom_page
    screenshot_on_failure(page)
    heads = page.locator(".labkit-control-heads input")
    heads.fill("3")                                   # 32 KV heads cannot group 3 heads
    heads.press("Enter")
    page.locator(".labkit-error", has_text="kv_heads=32 does not divide heads=3").wait_for(timeout=30_000)
    broken = page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea img')]
        .filter(img => img.offsetParent !== null && !(img.naturalWidth > 0)).length""")
    assert broken == 0, "an empty image (a broken-image icon) is shown in the error state"
    heads.fill("32")
    heads.press("Enter")
    page.locator(".labkit-error").first.wait_for(state="detached", timeout=30_000)


def test_whole_number_fields_refuse_decimals_and_exponents(custom_page, screenshot_on_failure):
    """IntText's front end deleted '.' and 'e' as they were typed ('2.5' became 25, '1e3' 13);
    every whole-number field now keeps what was typed and the calculator names the field."""
    import ipywidgets as widgets

    page = custom_page
    screenshot_on_failure(page)
    typed = {name: w for name, w in _controls().items() if isinstance(w, widgets.Text)}
    assert {"batch_size", "microbatches", "dp", "layers", "vocab", "ranks"} <= set(typed)
    for text in ("2.5", "1e3"):
        for name in typed:
            box = page.locator(f".labkit-control-{name} input")
            box.fill("")
            box.press_sequentially(text)               # key by key, as a learner types
            box.press("Enter")
            assert box.input_value() == text, f"{name}: the field changed {text!r} as it was typed"
        needles = [f"{w.description}={text!r}" for w in typed.values()]
        page.wait_for_function(
            """(needles) => { const shown = [...document.querySelectorAll('.labkit-error')]
                 .map(e => e.innerText).join(' ');
               return needles.every(n => shown.includes(n)); }""", arg=needles, timeout=30_000)
    for name, w in typed.items():                      # back to the starting values
        box = page.locator(f".labkit-control-{name} input")
        box.fill(w.value)
        box.press("Enter")
    page.wait_for_function("() => document.querySelectorAll('.labkit-error').length === 0",
                           timeout=30_000)


def _wait_for_verdict(page, start: str) -> None:
    page.wait_for_function(
        "(start) => { const v = document.querySelector('.labkit-verdict');"
        " return v !== null && v.innerText.startsWith(start); }", arg=start, timeout=30_000)
