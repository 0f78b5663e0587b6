"""Tier 4, a real browser: the URL `make lab` prints opens the welcome notebook (not the
Launcher), and a learner with fresh Jupyter settings is not asked about "Jupyter news".
Skipped where Chromium or playwright is not installed."""
from __future__ import annotations

import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from lab_server import CHROMIUM, CHROMIUM_ARGS, require_browser, serving

from labkit.course.outline import repo_root

pytestmark = [pytest.mark.server, pytest.mark.slow]
SCREENSHOT = Path(tempfile.gettempdir()) / "labkit-landing-test-failure.png"
NEWS = "official Jupyter news"
NOTIFICATION = "@jupyterlab/apputils-extension:notification"


@pytest.fixture
def course_server(tmp_path):
    """`labkit course` as `make lab` starts it (a token of Jupyter's choosing), with a learner's
    fresh Jupyter directories; yields the URL it printed."""
    require_browser()
    env = {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    cmd = [sys.executable, "-m", "labkit", "course", "--port", "0", "--no-browser"]
    with serving(cmd, repo_root(), tmp_path / "runtime", env) as info:
        log, urls = tmp_path / "jupyterlab.log", []
        deadline = time.time() + 30
        while not urls and time.time() < deadline:     # the URL is printed just after start-up
            urls = re.findall(rf"http://127\.0\.0\.1:{info['port']}/\S+", log.read_text())
            time.sleep(0.2)
        assert urls, f"no URL printed:\n{log.read_text()[-3000:]}"
        yield urls[0], info


def test_printed_url_opens_the_welcome_notebook_without_news(course_server):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    url, info = course_server
    settings = f"http://127.0.0.1:{info['port']}/lab/api/settings/{NOTIFICATION}?token={info['token']}"
    with urllib.request.urlopen(settings, timeout=30) as r:
        reply = json.loads(r.read())
    # what the page computes: the schema's defaults (the server's overrides applied), then the user's
    defaults = {k: v.get("default") for k, v in reply["schema"]["properties"].items()}
    composite = {**defaults, **reply["settings"]}
    assert composite.get("fetchNews") == "false" and composite.get("checkForUpdates") is False, composite
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(url)
            current = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current")
            current.wait_for(timeout=60_000)
            try:
                page.wait_for_selector(".jp-NotebookPanel:visible .jp-Cell", timeout=60_000)
            except PlaywrightTimeout:
                pytest.fail(f"{url} opened no notebook; the open tab is {current.inner_text()!r}")
            assert current.inner_text().strip() == "00_welcome.ipynb"
            assert page.locator(".jp-Launcher:visible").count() == 0, "the Launcher is showing"
            # The news question is asked (if at all) right after the page is restored.
            page.wait_for_timeout(3_000)
            assert page.get_by_text(NEWS).count() == 0, "the 'Jupyter news' pop-up is showing"
        except Exception:
            page.screenshot(path=str(SCREENSHOT))
            print(f"screenshot of the failing page: {SCREENSHOT}")
            raise
        finally:
            browser.close()
