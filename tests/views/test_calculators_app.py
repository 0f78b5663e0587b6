"""`labkit calculators`: the course's calculators as one standalone Voila app.

Without a server: the command line (port, token, --expose; what reaches Voila and what is
printed, with Voila itself replaced by a stand-in), the app notebook shipped in the package, and
the app built in plain Python (a tab per calculator, each built when opened, each live).

Tier 4, a real browser (marked server and slow): `labkit calculators` started as a learner
starts it, the URL it prints opened in headless Chromium; the server listens on 127.0.0.1 only
and refuses the page without the token; no code is shown; in every tab a typed control changes
the verdict and the figure, and '2.5' in a whole-number field gets a message naming the field.
With LABKIT_SCREENSHOTS=1 it writes the screenshots in docs/screenshots/ (those linked from
the README; each under 300 KB), else takes none. Skipped where Chromium or playwright is missing.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lab_server import stop_group

from labkit.cli import calculators as cli

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 "--disable-sync"]
TOKEN = "labkit-app-test"
SCREENSHOT_LIMIT = 300_000          # bytes per committed PNG
FAILURE_SHOT = Path(tempfile.gettempdir()) / "labkit-app-test-failure.png"


# ---- the command line, no server ----------------------------------------------------------

def parse(*argv):
    parser = argparse.ArgumentParser(prog="labkit calculators", exit_on_error=False)
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_local_with_a_random_token():
    args = parse()
    assert (args.port, args.token, args.expose, args.no_browser) == (None, None, False, False)


@pytest.mark.parametrize("argv, message", [
    (["--port", "http"], "--port=http is not a port; allowed: 0 (any free port) to 65535"),
    (["--port", "70000"], "--port=70000 is not a port"),
    (["--port", "-1"], "--port=-1 is not a port"),
    (["--token", ""], "--token='' would turn authentication off"),
    (["--token", "a b"], "has spaces or one of & ? # / %"),
    (["--token", "a&b"], "has spaces or one of & ? # / %"),
])
def test_bad_flags_get_a_message(argv, message, capsys):
    parser = argparse.ArgumentParser(prog="labkit calculators")
    cli.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_voila_command_binds_localhost_hides_code_and_keeps_its_port():
    cmd = cli.voila_command(8123, "tok")
    assert cmd[:3] == [sys.executable, "-m", "voila"]
    assert Path(cmd[3]) == cli.notebook_path() and cli.notebook_path().is_file()
    for arg in ("--Voila.ip=127.0.0.1", "--port=8123", "--Voila.port_retries=0", "--token=tok",
                "--no-browser", "--strip_sources=True", "--show_tracebacks=False"):
        assert arg in cmd, arg
    exposed = cli.voila_command(8123, "tok", expose=True)
    assert "--Voila.ip=0.0.0.0" in exposed and "--Voila.ip=127.0.0.1" not in exposed
    with pytest.raises(ValueError, match="token='' would turn authentication off"):
        cli.voila_command(8123, " ")
    with pytest.raises(ValueError, match="port=0 is not a port to serve on"):
        cli.voila_command(0, "tok")


@pytest.fixture
def busy_port():
    """A port something listens on (this test's socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_choice(busy_port, monkeypatch):
    with pytest.raises(ValueError, match=f"port {busy_port} on 127.0.0.1 is in use"):
        cli.choose_port(busy_port, "127.0.0.1")
    free = cli.choose_port(0, "127.0.0.1")
    assert free not in (0, busy_port) and cli.choose_port(free, "127.0.0.1") == free
    # the default port taken: another one, free, instead of an error
    monkeypatch.setattr(cli, "DEFAULT_PORT", busy_port)
    other = cli.choose_port(None, "127.0.0.1")
    assert other != busy_port and cli._bindable("127.0.0.1", other)


class FakeVoila:
    """Stands in for subprocess.Popen: records the command, 'serves' until waited on."""
    started: list = []

    def __init__(self, cmd, **kwargs):
        self.cmd, self.kwargs = cmd, kwargs
        FakeVoila.started.append(self)

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


@pytest.fixture
def fake_voila(monkeypatch):
    FakeVoila.started = []
    monkeypatch.setattr(subprocess, "Popen", FakeVoila)
    monkeypatch.setattr(signal, "signal", lambda *a: None)   # leave pytest's handlers alone
    monkeypatch.setattr(cli.webbrowser, "open", lambda url: pytest.fail(f"opened {url}"))
    return FakeVoila.started


def test_run_prints_the_url_with_its_token_and_starts_voila_on_it(fake_voila, capsys):
    assert cli.run(parse("--port", "0", "--no-browser")) == 0
    (voila,) = fake_voila
    out, err = capsys.readouterr()
    port = int(next(a for a in voila.cmd if a.startswith("--port=")).split("=")[1])
    token = next(a for a in voila.cmd if a.startswith("--token=")).split("=", 1)[1]
    assert len(token) >= 20, "the random token is too short to guess-proof the server"
    assert f"http://127.0.0.1:{port}/?token={token}" in out
    assert "WARNING" not in out + err and "--Voila.ip=127.0.0.1" in voila.cmd
    assert voila.kwargs["cwd"] == cli.notebook_path().parent
    assert voila.kwargs["env"]["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    cli.run(parse("--port", "0", "--no-browser"))
    assert fake_voila[1].cmd != voila.cmd, "two runs got the same token (and port)"
    assert cli.run(parse("--port", "0", "--no-browser", "--token", "mine")) == 0
    assert "--token=mine" in fake_voila[2].cmd and "?token=mine" in capsys.readouterr().out


def test_expose_binds_every_interface_and_says_so_loudly(fake_voila, capsys):
    assert cli.run(parse("--expose", "--port", "0", "--no-browser", "--token", "t")) == 0
    out, err = capsys.readouterr()
    assert "--Voila.ip=0.0.0.0" in fake_voila[0].cmd and "--token=t" in fake_voila[0].cmd
    assert "WARNING: --expose serves on EVERY network interface" in err
    assert "every network interface" in out and "?token=t" in out


def test_a_taken_port_is_an_error_naming_it(fake_voila, busy_port, capsys):
    assert cli.run(parse("--port", str(busy_port), "--no-browser")) == 2
    assert fake_voila == []
    assert f"port {busy_port} on 127.0.0.1 is in use" in capsys.readouterr().err


def test_the_labkit_command_knows_calculators():
    """`labkit calculators` (and `make calculators`) reach this module."""
    from labkit.cli import COMMANDS

    assert COMMANDS.get("calculators", (None,))[0] == "calculators", \
        "register 'calculators' in labkit/cli/__init__.py COMMANDS"


# ---- the app notebook and the app, no server ----------------------------------------------

def test_the_app_notebook_is_shipped_clean():
    nb = json.loads(cli.notebook_path().read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code), \
        "commit the app notebook without outputs"
    assert "CalculatorsApp" in "".join(code[0]["source"])
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.slow
def test_every_tab_builds_its_calculator_when_opened_and_each_is_live():
    """The page starts with one calculator built; selecting a tab builds its own, which then
    recomputes when a control changes (verdict and figure) and names a bad field."""
    import ipywidgets as widgets

    from labkit.app import CALCULATORS, KEYS, CalculatorsApp
    from labkit.widgets import whole_number

    app = CalculatorsApp()
    assert list(app.built) == ["memory"] and app.tabs.titles == tuple(e.title for e in CALCULATORS)
    for index, key in enumerate(KEYS):
        app.tabs.selected_index = index                        # a click on the tab
        calc = app.built[key]
        assert calc is not None and calc.widget in app.pages[key].children, key
        if key == "quiz":
            continue                                           # driven below
        name, value = CHANGES[key]
        field = calc.controls[name]
        result = calc.verdict if key == "memory" else calc.result
        before = (result.value, calc.figure.value)
        field.value = value
        assert result.value != before[0] and calc.figure.value != before[1], key
        assert f'class="{RESULT.get(key, ".labkit-verdict")[1:]}"' in result.value, key
        field.value = "2.5"
        with pytest.raises(ValueError) as expected:
            whole_number(field.description, "2.5")
        assert "labkit-error" in result.value and str(expected.value).replace("'", "&#x27;") \
            in result.value, key
    assert set(app.built) == set(KEYS)
    quiz = app.built["quiz"]
    quiz.count.value = "2.5"
    quiz.start.click()
    assert "questions=&#x27;2.5&#x27; is not a whole number" in quiz.message.value
    quiz.count.value = "1"
    quiz.start.click()
    assert quiz.state == "asking" and "Question 1 of 1" in quiz.question_html.value
    assert isinstance(quiz.widget, widgets.VBox)


def test_a_calculator_that_cannot_start_says_so_in_its_tab(monkeypatch):
    import labkit.app as app_module
    from labkit.app import CALCULATORS, CalculatorsApp, Entry

    broken = Entry("quiz", "Quiz", "quiz", "NoSuchWidget", "?")
    monkeypatch.setattr(app_module, "CALCULATORS", [*CALCULATORS[:-1], broken])
    app = CalculatorsApp()
    assert app.calculator("quiz") is None
    shown = app.pages["quiz"].children[-1].value
    assert "labkit-error" in shown and "The Quiz calculator could not start" in shown
    assert "NoSuchWidget" in shown
    with pytest.raises(ValueError, match="'nope' is not a calculator; allowed: memory, comm"):
        app.calculator("nope")
    with pytest.raises(ValueError, match="selected='nope' is not a calculator"):
        CalculatorsApp(selected="nope")


# In each tab: a whole-number field and a new value that changes the verdict and the figure.
CHANGES = {
    "memory": ("batch_size", "4"),
    "comm": ("ranks", "16"),
    "ddp": ("gpus", "64"),
    "zero": ("dp", "64"),
    "fsdp": ("dp", "64"),
    "checkpoint": ("gpus", "16000"),
    "tp": ("tp", "4"),
    "pipeline": ("microbatches", "16"),
    "moe": ("batch_size", "4"),
    "planner": ("gpus", "128"),
}
# Where each tab shows its result: a verdict line, or (checkpoints) a table.
RESULT = {"checkpoint": ".labkit-table"}


# ---- tier 4: the app in a real browser ----------------------------------------------------

@pytest.fixture(scope="module")
def app_server(tmp_path_factory):
    """`labkit calculators --no-browser --port 0 --token T` as a learner starts it; yields the
    URL it printed and the server's process; kills the process group at the end."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    pytest.importorskip("voila", reason="voila is not installed (pip install 'voila>=0.5,<0.6')")
    tmp = tmp_path_factory.mktemp("app")
    cmd = [sys.executable, "-m", "labkit", "calculators", "--no-browser", "--port", "0",
           "--token", TOKEN]
    log_path = tmp / "voila.log"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline, url = time.time() + 90, None
        while True:
            tail = log_path.read_text()[-3000:]
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{tail}"
            assert time.time() < deadline, f"no server within 90 s:\n{tail}"
            found = re.findall(r"http://127\.0\.0\.1:(\d+)/\?token=(\S+)", log_path.read_text())
            if found:
                port, token = found[0]
                url = f"http://127.0.0.1:{port}/?token={token}"
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", int(port))) == 0:
                        break
            time.sleep(0.2)
        assert token == TOKEN
        yield url, int(port), proc, log_path
    finally:
        import psutil

        try:   # Voila's kernels run in sessions of their own: a signal to the group misses them
            started = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        stop_group(proc, timeout=30)
        _, alive = psutil.wait_procs(started, timeout=30)
        for p in alive:
            p.kill()
        assert not alive, f"left running after the server stopped: {[p.cmdline() for p in alive]}"


def _listening_addresses(pid: int, port: int) -> set[str]:
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {c.laddr.ip for p in procs for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.server
@pytest.mark.slow
def test_server_is_local_and_wants_the_token(app_server):
    url, port, proc, _ = app_server
    assert _listening_addresses(proc.pid, port) == {"127.0.0.1"}
    base = url.split("?")[0]
    for wrong in (base, f"{base}?token=wrong"):
        try:
            with urllib.request.urlopen(wrong, timeout=60) as reply:
                body, where = reply.read().decode(), reply.url
        except urllib.error.HTTPError as exc:          # 403 is as good a refusal as a login page
            assert exc.code in (401, 403), exc
            continue
        assert "login" in where and "widget-view" not in body, f"{wrong} served the app"


def _screenshot_dir() -> Path | None:
    """docs/screenshots/ with LABKIT_SCREENSHOTS=1; else None: no pictures (each costs about a
    second of a loaded 2-core machine)."""
    return REPO / "docs" / "screenshots" if os.environ.get("LABKIT_SCREENSHOTS") == "1" else None


def _save(page, path: Path | None, locator=None) -> int:
    """A PNG of the page (or of `locator`), in 256 colours to stay small; its size in bytes
    (0 when no pictures are wanted: path None)."""
    from PIL import Image

    if path is None:
        return 0
    if locator is not None:
        png = locator.screenshot()
    else:
        # Voila scrolls a container, not the document, so full_page would stop at the window:
        # make the window as tall as the app for the picture instead.
        size = page.viewport_size
        bottom = page.evaluate("() => document.querySelector('.labkit-app-tabs')"
                               ".getBoundingClientRect().bottom")
        page.set_viewport_size({"width": size["width"], "height": max(size["height"],
                                                                      int(bottom) + 24)})
        page.wait_for_timeout(300)                       # let the page re-lay out
        png = page.screenshot()
        page.set_viewport_size(size)
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return path.stat().st_size


def _figures(page, key):
    return page.eval_on_selector_all(f".labkit-app-{key} img", "els => els.map(e => e.src)")


def _text(page, selector):
    return page.evaluate("(s) => { const e = document.querySelector(s);"
                         " return e === null ? null : e.innerText; }", selector)


@pytest.mark.server
@pytest.mark.slow
def test_every_calculator_is_live_in_the_browser(app_server):
    from playwright.sync_api import expect, sync_playwright

    from labkit.app import KEYS
    from labkit.widgets import whole_number

    url, _, _, log_path = app_server
    shots = _screenshot_dir()
    sizes = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(url, timeout=90_000)
            page.locator(".labkit-app-memory .labkit-verdict").wait_for(timeout=90_000)
            # no code: Voila strips the cell's source, and no editor or prompt is drawn
            text = page.inner_text("body")
            source = json.loads(cli.notebook_path().read_text())["cells"][0]["source"]
            shown = [line for line in "".join(source).splitlines()
                     if line.strip() and line.strip() in text]
            assert not shown, f"the page shows the app's code: {shown}"
            assert page.locator(".jp-InputArea, .jp-CodeMirrorEditor, .cm-editor").count() == 0
            tabs = page.locator(".labkit-app-tabs .lm-TabBar-tab")
            assert tabs.count() == len(KEYS)
            sizes["app"] = _save(page, shots and shots / "app.png")       # as it opens
            for index, key in enumerate(KEYS):
                tabs.nth(index).click()
                if key == "quiz":
                    sizes[key] = _drive_quiz(page, shots)
                    continue
                verdict = f".labkit-app-{key} {RESULT.get(key, '.labkit-verdict:not(.labkit-fit)')}"
                page.locator(verdict).wait_for(timeout=60_000)
                before, figures = _text(page, verdict), _figures(page, key)
                assert figures, f"{key}: no figure"
                name, value = CHANGES[key]
                box = page.locator(f".labkit-app-{key} .labkit-control-{name} input")
                box.fill(value)
                box.press("Enter")
                page.wait_for_function(
                    "([s, before]) => { const e = document.querySelector(s);"
                    " return e !== null && e.innerText !== before; }",
                    arg=[verdict, before], timeout=60_000)
                page.wait_for_function(
                    "([s, before]) => {"
                    " const now = [...document.querySelectorAll(s)].map(e => e.src);"
                    " return now.length > 0 && now.join() !== before.join(); }",
                    arg=[f".labkit-app-{key} img", figures], timeout=60_000)
                sizes[key] = _save(page, shots and shots / f"{key}.png")
                # a decimal in a whole-number field: a message naming the field, no result
                label = page.locator(f".labkit-app-{key} .labkit-control-{name} label").inner_text()
                with pytest.raises(ValueError) as expected:
                    whole_number(label.strip(), "2.5")
                box.fill("2.5")
                box.press("Enter")
                error = page.locator(f".labkit-app-{key} .labkit-error")
                expect(error).to_contain_text(str(expected.value), timeout=60_000)
                assert page.locator(verdict).count() == 0, f"{key}: a verdict beside the error"
                if key == "pipeline":
                    sizes["bad-input"] = _save(page, shots and shots / "bad-input.png",
                                               page.locator(f".labkit-app-{key}"))
        except Exception:
            page.screenshot(path=str(FAILURE_SHOT))
            print(f"screenshot of the failing page: {FAILURE_SHOT}\nserver log: {log_path}")
            raise
        finally:
            browser.close()
    big = {k: v for k, v in sizes.items() if v > SCREENSHOT_LIMIT}
    assert not big, f"screenshots over {SCREENSHOT_LIMIT:,} bytes: {big}"


def _drive_quiz(page, shots: Path | None) -> int:
    """Quiz tab: the topic changes how many questions are offered; '2.5' questions gets a
    message; one question started, answered and scored."""
    from playwright.sync_api import expect

    quiz = page.locator(".labkit-app-quiz")
    quiz.locator(".labkit-control-count input").wait_for(timeout=60_000)
    offered = quiz.locator(".widget-label", has_text=re.compile(r"^of \d+$"))
    before = offered.inner_text()
    quiz.locator(".labkit-control-topic select").select_option("pp")
    page.wait_for_function("([el, before]) => el.innerText !== before",
                           arg=[offered.element_handle(), before], timeout=60_000)
    count = quiz.locator(".labkit-control-count input")
    count.fill("2.5")
    count.press("Enter")
    quiz.locator(".labkit-control-start").click()
    expect(quiz.locator(".labkit-error")).to_contain_text(
        "questions='2.5' is not a whole number", timeout=60_000)
    count.fill("1")
    count.press("Enter")
    quiz.locator(".labkit-control-start").click()
    quiz.locator(".labkit-quiz-question").wait_for(timeout=60_000)
    expect(quiz.locator(".labkit-error")).to_have_count(0, timeout=60_000)
    answer = quiz.locator(".labkit-control-answer input")
    # a number to type or an option to pick, whichever this question shows
    quiz.locator(".labkit-control-answer input:visible, "
                 ".labkit-control-choice input:visible").first.wait_for(timeout=60_000)
    if answer.is_visible():
        answer.fill("1")
    else:
        quiz.locator(".labkit-control-choice input[type=radio]").first.check()
    quiz.locator(".labkit-control-submit").click()
    quiz.locator(".labkit-quiz-feedback").wait_for(timeout=60_000)
    expect(quiz.locator(".labkit-quiz-score")).to_contain_text("Score:", timeout=60_000)
    return _save(page, shots and shots / "quiz.png")
