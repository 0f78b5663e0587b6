"""Tier 4: a lesson as a learner runs it. JupyterLab in headless Chromium opens a copy of a
lesson that draws labkit.plots figures: its tab is not marked modified a few seconds after
opening (the committed metadata is what JupyterLab writes: labkit.course.exercises.
NOTEBOOK_METADATA); then Run > Run All Cells, and every cell runs without an error and every
figure is an <img> with a size (never the text `<Figure size ...>`). Skipped where Chromium or
playwright is not installed (.ci/run installs both), like test_browser.py.
LABKIT_RUN_ALL_LESSONS=05_fsdp.ipynb,07_pipeline_parallel.ipynb runs others; with
LABKIT_SCREENSHOTS=1 each figure cell's output is saved to docs/screenshots/ as a learner sees it."""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import nbformat
import pytest
from conftest import ROOT
from lab_server import CHROMIUM, CHROMIUM_ARGS, require_browser, serving

from labkit.cli.course import lab_command

pytestmark = [pytest.mark.server, pytest.mark.slow]
TOKEN = "labkit-run-all-test"
LESSON = "06_tensor_parallel.ipynb"     # four labkit.plots figures, five labs: 15 s to 1 min
LESSONS = os.environ.get("LABKIT_RUN_ALL_LESSONS", LESSON).split(",")
SHOTS = ROOT / "docs" / "screenshots" if os.environ.get("LABKIT_SCREENSHOTS") else None
RUN_ALL_LIMIT_MS = 600_000   # Run All of the lesson on a loaded 2-core machine, with room
# a cell draws a figure when it calls a labkit.plots module's function (tp_plots.weight_split(...))
DRAWS = re.compile(r"\b\w*plots\.\w+\(|\b\w+_figure\(")


@pytest.fixture(scope="module", params=LESSONS)
def lab(tmp_path_factory, request):
    lesson = request.param
    require_browser()
    tmp_path = tmp_path_factory.mktemp("run-all")
    root = tmp_path / "root"
    root.mkdir()
    # a copy, byte for byte: Run All's autosave must not write outputs into the checkout
    shutil.copyfile(ROOT / "notebooks" / lesson, root / lesson)
    settings = tmp_path / "settings" / "@jupyterlab"
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # every cell in the page (no windowing), so that each cell's outputs can be read
    (settings / "notebook-extension").mkdir()
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))
    env = {"JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    cmd = lab_command(port=0, token=TOKEN, open_browser=False, notebook=lesson)
    cmd = [f"--ServerApp.root_dir={root}" if a.startswith("--ServerApp.root_dir=") else a for a in cmd]
    with serving(cmd, root, tmp_path / "runtime", env) as info:
        yield f"http://127.0.0.1:{info['port']}", root / lesson, tmp_path


def _figure_cells(path) -> list[int]:
    nb = nbformat.read(path, as_version=4)
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and DRAWS.search(c.source)]


# Per cell of the page: its kind, its prompt, its errors, its images (drawn or not) and any
# matplotlib repr text shown instead of a figure.
CELLS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(cell => ({
  code: cell.classList.contains('jp-CodeCell'),
  prompt: (cell.querySelector('.jp-InputPrompt') || {innerText: ''}).innerText.trim(),
  errors: [...cell.querySelectorAll('.jp-OutputArea-output[data-mime-type*="error"]')]
            .map(e => e.innerText.slice(0, 2000)),
  images: [...cell.querySelectorAll('.jp-OutputArea-output img')].map(img => {
      const r = img.getBoundingClientRect();
      return {natural: img.naturalWidth, width: r.width, height: r.height}; }),
  figureText: /<Figure size [^>]*>/.test(
      (cell.querySelector('.jp-OutputArea') || {innerText: ''}).innerText),
}))"""


def _save_figures(page, lesson: str, figure_cells: list[int]) -> None:
    """Each figure cell's output area as JupyterLab shows it, docs/screenshots/LESSON-figN.png."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    stem = lesson.removesuffix(".ipynb")
    for n, i in enumerate(figure_cells, 1):
        area = page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-OutputArea")
        area.scroll_into_view_if_needed()
        area.screenshot(path=str(SHOTS / f"{stem}-fig{n}.png"))
    nb = nbformat.read(ROOT / "notebooks" / lesson, as_version=4)
    ranks = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and c.source.startswith("%%ranks")][:2]      # the per-rank columns, as shown
    for n, i in enumerate(ranks, 1):
        area = page.locator(".jp-Notebook .jp-Cell").nth(i).locator(".jp-OutputArea")
        area.scroll_into_view_if_needed()
        area.screenshot(path=str(SHOTS / f"{stem}-ranks{n}.png"))


def test_a_lesson_opens_unmodified_and_runs_all_with_its_figures(lab):
    from playwright.sync_api import sync_playwright

    server, path, tmp_path = lab
    lesson = path.name
    committed = path.read_bytes()
    shot = tmp_path / "run-all.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{server}/lab/tree/{lesson}?reset&token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            # Under load JupyterLab may ask which kernel to use: take the default (python3).
            dialog = page.locator(".jp-Dialog .jp-mod-accept")
            if dialog.count():
                dialog.first.click()
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                   timeout=90_000)
            time.sleep(5)   # JupyterLab writes the kernel's metadata about 3 s after opening
            dirty = page.evaluate("() => [...document.querySelectorAll("
                                  "'.lm-TabBar-tab.jp-mod-dirty')].map(t => t.innerText)")
            assert dirty == [], (f"tabs marked modified {dirty} right after opening, with no edit: "
                                 "the notebook's metadata is not what JupyterLab writes "
                                 "(labkit.course.exercises.NOTEBOOK_METADATA)")
            assert path.read_bytes() == committed, "opening the notebook rewrote it on disk"

            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()
            started = time.monotonic()
            # done: every code cell has a number in its prompt, none is queued or running
            page.wait_for_function(
                """() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                     .map(e => e.innerText.trim());
                   return p.length > 0 && p.every(t => /^\\[\\d+\\]:$/.test(t)); }""",
                timeout=RUN_ALL_LIMIT_MS, polling=1000)
            took = time.monotonic() - started
            page.wait_for_timeout(1_000)      # the last outputs and images settle
            cells = page.evaluate(CELLS)
            if SHOTS:
                _save_figures(page, lesson, _figure_cells(path))
        except Exception:
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot of the failing page: {shot}")
            raise
        finally:
            browser.close()
    print(f"Run All of {lesson} in JupyterLab took {took:.0f} s")
    nb_cells = nbformat.read(ROOT / "notebooks" / lesson, as_version=4).cells
    assert len(cells) == len(nb_cells), f"the page shows {len(cells)} cells, the notebook has {len(nb_cells)}"
    errors = {i: c["errors"] for i, c in enumerate(cells) if c["errors"]}
    assert not errors, f"cells that raised (index: error text): {errors}"
    for i in _figure_cells(ROOT / "notebooks" / lesson):
        c = cells[i]
        assert not c["figureText"], f"cell {i} shows `<Figure size ...>` text instead of its figure"
        assert c["images"], f"cell {i} draws a figure and shows no <img>"
        empty = [img for img in c["images"]
                 if not (img["natural"] > 0 and img["width"] > 0 and img["height"] > 0)]
        assert not empty, f"cell {i}: images with no size (not drawn): {empty}"
