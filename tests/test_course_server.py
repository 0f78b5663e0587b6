"""What `make lab` serves: JupyterLab on the course, 127.0.0.1 only, token required."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import pytest
from lab_server import serving

from labkit.cli.course import lab_command
from labkit.course.outline import repo_root

pytestmark = pytest.mark.server
TOKEN = "labkit-test-token"


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_course_server_lists_the_notebooks_with_the_token(tmp_path):
    # The exact command `labkit course` (and so `make lab`) runs, on a port the OS picks.
    cmd = [sys.executable, "-m", "labkit", "course", "--port", "0", "--token", TOKEN, "--no-browser"]
    assert "notebooks/00_welcome.ipynb" in lab_command()
    env = {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    with serving(cmd, repo_root(), tmp_path / "runtime", env) as info:
        assert info["hostname"] in ("127.0.0.1", "localhost") and info["token"] == TOKEN
        base = f"http://127.0.0.1:{info['port']}"
        status, body = _get(f"{base}/api/contents/notebooks?token={TOKEN}")
        assert status == 200
        names = [c["name"] for c in json.loads(body)["content"]]
        assert "00_welcome.ipynb" in names
        status, _ = _get(f"{base}/api/contents/notebooks")
        assert status == 403, "the server must refuse requests without the token"
        status, _ = _get(f"{base}/lab/tree/notebooks/00_welcome.ipynb?token={TOKEN}")
        assert status == 200
