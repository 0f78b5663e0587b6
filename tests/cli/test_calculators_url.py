"""`labkit calculators` prints its URL only once Voila answers on it (issue 28, item 12: printed
about 4 s before Voila listened, the URL opened at once showed ERR_CONNECTION_REFUSED). Voila is
replaced by a stand-in HTTP server that starts listening a second after it is started."""
from __future__ import annotations

import argparse
import http.server
import signal
import subprocess
import sys
import threading
import time

import pytest

from labkit.cli import calculators as cli

DELAY = 1.0          # seconds the stand-in takes to listen, as Voila takes about 4


class Refusing(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):                     # Voila without the token
        self.send_response(403)
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


class SlowVoila:
    """Stands in for subprocess.Popen: listens on the --port it was given DELAY s later."""
    started: list = []

    def __init__(self, cmd, **kwargs):
        self.port = int(next(a for a in cmd if a.startswith("--port=")).split("=")[1])
        self.listening_at = None
        self.server = None
        SlowVoila.started.append(self)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        time.sleep(DELAY)
        self.server = http.server.HTTPServer(("127.0.0.1", self.port), Refusing)
        self.listening_at = time.monotonic()
        self.server.serve_forever(poll_interval=0.05)

    def poll(self):
        return None

    def wait(self, timeout=None):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        return 0


class Stamped:
    """sys.stdout that remembers when each piece of text was written."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass

    def first(self, needle: str) -> float:
        return next(t for t, text in self.writes if needle in text)

    def text(self) -> str:
        return "".join(text for _, text in self.writes)


@pytest.fixture
def slow_voila(monkeypatch):
    SlowVoila.started = []
    monkeypatch.setattr(subprocess, "Popen", SlowVoila)
    monkeypatch.setattr(signal, "signal", lambda *a: None)   # leave pytest's handlers alone
    return SlowVoila.started


def run(*argv) -> int:
    parser = argparse.ArgumentParser(prog="labkit calculators")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


@pytest.mark.parametrize("browser", [False, True])
def test_the_url_is_printed_and_opened_only_once_the_server_answers(slow_voila, monkeypatch,
                                                                     browser):
    out, opened = Stamped(), []
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(cli.webbrowser, "open", lambda url: opened.append((time.monotonic(), url)))
    assert run("--port", "0", "--token", "tok", *([] if browser else ["--no-browser"])) == 0
    (voila,) = slow_voila
    url = f"http://127.0.0.1:{voila.port}/?token=tok"
    assert voila.listening_at is not None, out.text()
    assert out.first(url) >= voila.listening_at, (
        f"the URL was printed {voila.listening_at - out.first(url):.2f} s before the server "
        f"listened:\n{out.text()}")
    assert out.first("Starting the course's calculators") < voila.listening_at   # said at once
    assert [u for _, u in opened] == ([url] if browser else [])
    assert all(t >= voila.listening_at for t, _ in opened)


def test_a_port_that_accepts_but_does_not_speak_http_is_not_ready():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()                          # accepts connections, never answers
        assert not cli.answers(s.getsockname()[1], timeout=0.5)
