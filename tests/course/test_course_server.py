"""What `make lab` serves: JupyterLab on the course, 127.0.0.1 only, token required, the welcome
notebook as its URL, and this environment first on the PATH of its terminals."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from lab_server import serving

from labkit.cli import course
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
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "TMPDIR": str(tmp)}
    with serving(cmd, repo_root(), tmp_path / "runtime", env) as info:
        assert [p.name for p in tmp.glob("labkit-course-*")], "the server's config dir is in TMPDIR"
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
    # stopped with SIGTERM (serving does so): the course's config directory goes with it
    assert list(tmp.glob("labkit-course-*")) == [], "labkit course left its config directory"


def _course_cmd(*extra: str) -> list[str]:
    """The exact command `make lab` runs, on a port the OS picks."""
    return [sys.executable, "-m", "labkit", "course", "--port", "0", "--no-browser", *extra]


def test_lab_env_puts_this_environment_first(tmp_path):
    env = course.lab_env(tmp_path, base={"PATH": f"/usr/bin{os.pathsep}{course.env_bin()}{os.pathsep}/bin",
                                         "JUPYTER_CONFIG_PATH": "/theirs"})
    path = env["PATH"].split(os.pathsep)
    assert path == [os.path.dirname(sys.executable), "/usr/bin", "/bin"]
    assert os.access(os.path.join(path[0], "labkit"), os.X_OK), "labkit is not in this environment's bin"
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(tmp_path), "/theirs"]
    if sys.prefix != sys.base_prefix:
        assert env["VIRTUAL_ENV"] == sys.prefix


def test_the_printed_url_is_the_welcome_notebook(tmp_path):
    env = {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    with serving(_course_cmd(), repo_root(), tmp_path / "runtime", env) as info:
        url = f"http://127.0.0.1:{info['port']}/lab/tree/notebooks/00_welcome.ipynb?token={info['token']}"
        log = (tmp_path / "jupyterlab.log").read_text()
        assert url in log, f"the server did not print {url}:\n{log[-3000:]}"
        assert _get(url)[0] == 200


def _terminal_says(base: str, token: str, command: str, timeout: float = 60) -> str:
    """Open a terminal in the server, type `command`, return what it printed."""
    from tornado.websocket import websocket_connect

    req = urllib.request.Request(f"{base}/api/terminals?token={token}", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as r:
        name = json.loads(r.read())["name"]
    marker = "END-OF-ANSWER"

    async def talk() -> str:
        ws = await websocket_connect(f"{base.replace('http', 'ws')}/terminals/websocket/{name}?token={token}")
        # the marker is printed by the shell, never echoed as typed: "END-OF-""ANSWER"
        ws.write_message(json.dumps(["stdin", f"{command}; echo END-OF-''ANSWER\r"]))
        out = ""
        while marker not in out:
            msg = await asyncio.wait_for(ws.read_message(), timeout)
            assert msg is not None, f"the terminal closed; it printed: {out!r}"
            kind, *data = json.loads(msg)
            out += data[0] if kind == "stdout" else ""
        ws.close()
        return out

    return asyncio.run(talk())


def test_labkit_is_first_on_the_path_in_a_jupyterlab_terminal(tmp_path):
    """`make lab` from a shell where .venv is not active, and a ~/.bashrc that puts other tools
    first: `labkit` and `python` in JupyterLab's terminal are still this environment's."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    other = tmp_path / "other-bin"
    other.mkdir()
    for tool in ("labkit", "python"):
        (other / tool).write_text("#!/bin/sh\necho not the course's\n")
        (other / tool).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text(f'export PATH="{other}:$PATH"\n')
    env = {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "HOME": str(home), "SHELL": bash, "PATH": f"{other}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    env.pop("VIRTUAL_ENV", None)
    with serving(_course_cmd(), repo_root(), tmp_path / "runtime", env) as info:
        out = _terminal_says(f"http://127.0.0.1:{info['port']}", info["token"],
                             "command -v labkit python; labkit --help | head -n 1")
    here = os.path.dirname(sys.executable)
    assert f"{here}/labkit" in out and f"{here}/python" in out, out
    assert "usage: labkit" in out and "not the course's" not in out, out


def test_bad_port_is_a_message_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "labkit", "course", "--port", "-1", "--no-browser"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--port=-1 is not a port; allowed: 0 (any free port) to 65535" in r.stderr
    assert "usage: labkit course" in r.stderr


def test_an_empty_token_is_refused_and_no_auth_must_be_asked_for(capsys):
    """Issue 11 (12): `--token ""` silently turned authentication off."""
    from labkit.cli import main
    from labkit.cli.course import lab_command
    r = subprocess.run([sys.executable, "-m", "labkit", "course", "--token", "", "--no-browser"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--token='' would turn authentication off" in r.stderr and "--no-auth" in r.stderr
    assert main(["course", "--token", "x", "--no-auth", "--no-browser"]) == 2
    assert "contradict" in capsys.readouterr().err
    for bad in ("", "   "):
        with pytest.raises(ValueError, match="authentication off"):
            lab_command(token=bad)
    cmd = lab_command(no_auth=True)
    assert "--IdentityProvider.token=" in cmd
    assert not any(c.startswith("--IdentityProvider.token=") for c in lab_command())


def test_no_auth_prints_a_warning(monkeypatch, capsys):
    import labkit.cli.course as course
    from labkit.cli import main
    started = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append(cmd)

        def wait(self, timeout=None):
            return 0
    monkeypatch.setattr(course.subprocess, "Popen", FakePopen)
    assert main(["course", "--no-auth", "--no-browser", "--port", "0"]) == 0
    assert "authentication is off" in capsys.readouterr().err
    assert "--IdentityProvider.token=" in started[0]
