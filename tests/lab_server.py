"""Start the course's JupyterLab (the command `make lab` runs) for a test, and always stop it."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 "--disable-sync"]


def require_browser() -> None:
    """Skip the test where Chromium or playwright is missing (.ci/run installs both)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


@contextlib.contextmanager
def serving(cmd: list[str], cwd, runtime_dir, env: dict | None = None, timeout: float = 90.0):
    """Run `cmd` (a JupyterLab command with --ServerApp.port=0) with its runtime files in
    `runtime_dir` and its log in `runtime_dir/../jupyterlab.log`; yield the server's info (port, token, ...) once it listens; kill its whole
    process group on the way out."""
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime_dir), **(env or {}))
    log = open(runtime_dir.parent / "jupyterlab.log", "wb")   # read it when a test fails
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline, info = time.time() + timeout, None
        while info is None:
            assert proc.poll() is None, f"JupyterLab exited early with {proc.returncode}"
            assert time.time() < deadline, f"JupyterLab did not start within {timeout:.0f} s"
            for f in runtime_dir.glob("jpserver-*.json") if runtime_dir.exists() else ():
                try:
                    info = json.loads(f.read_text())
                except json.JSONDecodeError:
                    time.sleep(0.2)  # being written
            time.sleep(0.2)
        yield info
    finally:
        stop_group(proc, timeout=20)
        log.close()


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM to the process group of `proc` (started with start_new_session=True), SIGKILL
    to it after `timeout` s; waits for `proc` either way."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
