"""`labkit calculators`: every calculator of the course in one web page, served by Voila (what
`make calculators` runs). No JupyterLab and no code: a tab per calculator, each live.

Bound to 127.0.0.1 with a token (random unless --token gives one) and the URL to open printed
with it. --expose binds every interface (0.0.0.0) instead, for a workshop room, and says so
loudly: the token is still required, and whoever has it gets a Python kernel on this machine
(Voila passes the page's kernel messages through).

Port: 8866 (Voila's usual one), or any free port when 8866 is taken; --port N asks for N (an
error if it is taken) and --port 0 for any free port. The port is chosen here and Voila is told
not to move off it, and the URL is printed once Voila answers on it: the printed URL works.
"""
from __future__ import annotations

import argparse
import errno
import os
import secrets
import socket
import sys
import webbrowser
from pathlib import Path

import labkit
from labkit.cli.course import port_number, serve   # --port's rule and the server's lifetime, as labkit course

DEFAULT_PORT = 8866
LOCAL, EVERYWHERE = "127.0.0.1", "0.0.0.0"


def notebook_path() -> Path:
    """The app notebook, shipped inside the package (labkit/app/calculators.ipynb). Found
    without importing labkit.app, which would load ipywidgets into this process for nothing."""
    return Path(labkit.__file__).resolve().parent / "app" / "calculators.ipynb"


def token_text(text: str) -> str:
    """--token: a non-empty token without spaces (it goes into a URL as typed)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "--token='' would turn authentication off; allowed: a non-empty token, or leave "
            "--token out for a random one")
    if any(ch.isspace() for ch in text) or any(ch in text for ch in "&?#/%"):
        raise argparse.ArgumentTypeError(
            f"--token={text!r} has spaces or one of & ? # / %; allowed: letters, digits, - _ . ~")
    return text


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def free_port(host: str) -> int:
    """A port nothing listens on now (the system's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def choose_port(requested: int | None, host: str) -> int:
    """None: DEFAULT_PORT, or a free port when it is taken; 0: a free port; N: N, or a
    ValueError saying it is taken and what to do."""
    if requested is None:
        return DEFAULT_PORT if _bindable(host, DEFAULT_PORT) else free_port(host)
    if requested == 0:
        return free_port(host)
    if not _bindable(host, requested):
        raise ValueError(f"port {requested} on {host} is in use (or not allowed); allowed: a "
                         "free port, or --port 0 (or no --port) for any free one")
    return requested


def voila_command(port: int, token: str, expose: bool = False) -> list[str]:
    """The Voila command: the app notebook, code hidden, on `port` (no moving to another),
    bound to 127.0.0.1 (0.0.0.0 with expose=True), token required, no browser of its own
    (`run` opens the URL with the token; Voila's would open a login page), warnings and errors
    only (its start-up lines print a URL with the token masked, `?token=...`, before it answers:
    `run` prints the one to open once it does)."""
    if not str(token).strip():
        raise ValueError("token='' would turn authentication off; allowed: a non-empty token")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port={port} is not a port to serve on; allowed: 1 to 65535 "
                         "(choose_port picks one)")
    return [sys.executable, "-m", "voila", str(notebook_path()),
            f"--Voila.ip={EVERYWHERE if expose else LOCAL}", f"--port={port}",
            "--Voila.port_retries=0", f"--token={token}", "--no-browser",
            "--strip_sources=True", "--show_tracebacks=False",
            "--theme=light", "--template=lab", "--Voila.log_level=WARN"]


def app_urls(port: int, token: str, expose: bool = False) -> list[str]:
    """The URLs to print: 127.0.0.1, and with expose this machine's name as the others reach it."""
    urls = [f"http://{LOCAL}:{port}/?token={token}"]
    if expose:
        urls.append(f"http://{socket.gethostname()}:{port}/?token={token}")
    return urls


EXPOSE_WARNING = (
    "labkit calculators: WARNING: --expose serves on EVERY network interface (0.0.0.0:{port}), "
    "not only this machine.\n"
    "  Anyone who can reach this machine and has the token can use the app, and through it a "
    "Python kernel running as you.\n"
    "  Share the URL only on a network you trust; leave --expose out to serve 127.0.0.1 only.")


def add_arguments(parser) -> None:
    parser.add_argument("--port", type=port_number, default=None,
                        help=f"port to serve on (default {DEFAULT_PORT}, or a free one if it is "
                             "taken; 0 picks a free one)")
    parser.add_argument("--token", type=token_text, default=None,
                        help="token the URL must carry (default: a random one, printed in the URL)")
    parser.add_argument("--expose", action="store_true",
                        help="serve on every network interface (0.0.0.0), not only 127.0.0.1 "
                             "(prints a warning; the token is still required)")
    parser.add_argument("--no-browser", action="store_true", help="do not try to open a browser")


def _env() -> dict[str, str]:
    """This environment's bin first on PATH, so the kernel Voila starts is this Python's."""
    env = dict(os.environ)
    here = os.path.dirname(sys.executable)
    rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != here]
    env["PATH"] = os.pathsep.join([here, *rest])
    return env


def run(args) -> int:
    host = EVERYWHERE if args.expose else LOCAL
    try:
        port = choose_port(args.port, host)
    except ValueError as exc:
        print(f"labkit calculators: {exc}", file=sys.stderr)
        return 2
    if not notebook_path().is_file():
        print(f"labkit calculators: the app notebook {notebook_path()} is missing; reinstall "
              "labkit (pip install -e .)", file=sys.stderr)
        return 1
    token = args.token or secrets.token_urlsafe(18)
    cmd = voila_command(port, token, expose=args.expose)
    if args.expose:
        print(EXPOSE_WARNING.format(port=port), file=sys.stderr, flush=True)
    urls = app_urls(port, token, expose=args.expose)
    where = "every network interface" if args.expose else "127.0.0.1 only"
    print(f"Starting the course's calculators (Voila, {where}) on port {port}; the URL follows "
          "once it answers (a few seconds).", flush=True)

    def when_starting(proc) -> None:
        _announce_when_answering(proc, port, urls, open_browser=not args.no_browser)
    return serve(cmd, cwd=notebook_path().parent, env=_env(), while_starting=when_starting)


def answers(port: int, timeout: float = 2.0) -> bool:
    """Whether an HTTP server answers on 127.0.0.1:`port` (any status: Voila says 403 without
    the token; a port that accepts connections before the app is up does not count)."""
    import http.client

    conn = http.client.HTTPConnection(LOCAL, port, timeout=timeout)
    try:
        conn.request("HEAD", "/")
        conn.getresponse()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _announce_when_answering(proc, port: int, urls: list[str], open_browser: bool = True,
                             timeout: float = 120.0) -> None:
    """Print the URLs once the server answers (printed earlier, opening one at once showed
    "connection refused" for about 4 s), then open the first in the learner's browser. A server
    that exits first gets its status and the URL it would have served; one that does not answer
    within `timeout` s gets the URLs with a note that it may still be starting."""
    import time

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not answers(port):
        time.sleep(0.2)
    if proc.poll() is not None:
        print(f"labkit calculators: Voila exited (status {proc.poll()}) before it answered on "
              f"{urls[0]}; its messages are above.", flush=True)
        return
    late = "" if answers(port) else f" (not answering yet after {timeout:g} s: still starting?)"
    print(f"The calculators are ready{late}. Open:", flush=True)
    for url in urls:
        print(f"    {url}", flush=True)
    print("Stop it with Ctrl-C.", flush=True)
    if open_browser:
        try:
            webbrowser.open(urls[0])
        except webbrowser.Error:
            pass                   # no browser here: the URL is printed above


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.cli.calculators ...`: the same command without the `labkit` front."""
    parser = argparse.ArgumentParser(prog="labkit calculators", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
