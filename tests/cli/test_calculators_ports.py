"""Ports: `labkit calculators --port N` right after a server on N stopped (only TIME-WAIT sockets
left) is not refused, as Voila itself would not refuse it; `labkit course --no-auth --port 0`
warns about the port it serves on, not ":0". No server is started."""
from __future__ import annotations

import errno
import os
import socket

import pytest

from labkit.cli import calculators, course


@pytest.fixture
def time_wait_port():
    """A port whose only sockets are in TIME-WAIT: a server on it (bound as tornado binds, with
    SO_REUSEADDR) answered and closed first."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()                 # the server side closes first: its socket goes to TIME-WAIT
    client.recv(1)
    client.close()
    server.close()
    with socket.socket() as plain:
        try:
            plain.bind(("127.0.0.1", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
        else:
            pytest.skip("this system lets a plain bind reuse a TIME-WAIT port")
    return port


@pytest.mark.skipif(os.name == "nt", reason="SO_REUSEADDR means something else on Windows")
def test_a_port_in_time_wait_is_free_to_the_server(time_wait_port):
    assert calculators._bindable("127.0.0.1", time_wait_port)
    assert calculators.choose_port(time_wait_port, "127.0.0.1") == time_wait_port


def test_a_listening_port_is_still_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not course.bindable("127.0.0.1", port)
        assert course.pinned_port(port) not in (0, port)


def test_no_auth_warns_about_the_port_it_serves_on(monkeypatch, capsys):
    from labkit.cli import main

    started = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append(cmd)

        def wait(self, timeout=None):
            return 0
    monkeypatch.setattr(course.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(course.signal, "signal", lambda *a: None)
    assert main(["course", "--no-auth", "--no-browser", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert "127.0.0.1:0" not in err
    (cmd,) = started
    port = int(next(a for a in cmd if a.startswith("--ServerApp.port=")).split("=")[1])
    assert port > 0 and f"127.0.0.1:{port} " in err
    assert "--ServerApp.port_retries=0" in cmd, "Jupyter must not move off the port warned about"
