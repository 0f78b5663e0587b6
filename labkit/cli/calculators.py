"""`labkit calculators`: every calculator of the course in one web page, served by Voila (what
`make calculators` runs). No JupyterLab and no code: a tab per calculator, each live.

Bound to 127.0.0.1 with a token (random unless --token gives one), the URL printed once Voila
answers on it. --expose binds 0.0.0.0 for a workshop room and says so loudly: the token is still
required, and whoever has it gets a Python kernel on this machine. Port: 8866, or a free one
when it is taken; --port N asks for N (an error if taken), --port 0 for any free port.

Each open page has a kernel (about 100 MB): shut down once no page has been connected to it and
it has done nothing for --cull-after s (default 60, so a closed page's goes within 75 s); at most
--max-kernels (default 40) at once, a page beyond that says to close a tab and reload.
"""
from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import webbrowser
from pathlib import Path

import labkit
# --port's rule, the port check and the server's lifetime, as labkit course
from labkit.cli.course import bindable, port_number, serve

DEFAULT_PORT = 8866
CULL_AFTER = 60          # s with no page connected and nothing done before a kernel is shut down
MAX_KERNELS = 40         # pages (kernels, about 100 MB each) at once: 4 GB for a workshop room
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


def positive(text: str) -> int:
    """argparse type for --cull-after and --max-kernels: a whole number from 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1")
    return value


def cull_interval(cull_after: int) -> int:
    """How often (s) the server looks for kernels to shut down: a quarter of --cull-after."""
    return max(1, cull_after // 4)


def _bindable(host: str, port: int) -> bool:
    """Whether Voila could listen on host:port (SO_REUSEADDR, as tornado binds: a port only in
    TIME-WAIT, a server on it just stopped, is free to it)."""
    return bindable(host, port)


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


def voila_command(port: int, token: str, expose: bool = False, cull_after: int = CULL_AFTER,
                  max_kernels: int = MAX_KERNELS) -> list[str]:
    """The Voila command: the app notebook, code hidden, on `port` (no moving to another),
    bound to 127.0.0.1 (0.0.0.0 with expose=True), token required, no browser of its own
    (`run` opens the URL with the token; Voila's would open a login page), warnings and errors
    only (its start-up lines print a URL with the token masked, `?token=...`, before it answers:
    `run` prints the one to open once it does). Kernels: at most `max_kernels`
    (labkit.app.kernels), each shut down after `cull_after` s with no page and no activity."""
    if not str(token).strip():
        raise ValueError("token='' would turn authentication off; allowed: a non-empty token")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port={port} is not a port to serve on; allowed: 1 to 65535 "
                         "(choose_port picks one)")
    return [sys.executable, "-m", "voila", str(notebook_path()),
            f"--Voila.ip={EVERYWHERE if expose else LOCAL}", f"--port={port}",
            "--Voila.port_retries=0", f"--token={token}", "--no-browser",
            "--strip_sources=True", "--show_tracebacks=False",
            "--theme=light", "--template=lab", "--Voila.log_level=WARN",
            "--VoilaConfiguration.multi_kernel_manager_class="
            "labkit.app.kernels.CappedKernelManager",
            f"--CappedKernelManager.max_kernels={max_kernels}",
            f"--CappedKernelManager.free_within={cull_after + cull_interval(cull_after)}",
            f"--MappingKernelManager.cull_idle_timeout={cull_after}",
            f"--MappingKernelManager.cull_interval={cull_interval(cull_after)}",
            "--MappingKernelManager.cull_connected=False"]


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
    parser.add_argument("--cull-after", type=positive, default=CULL_AFTER, metavar="SECONDS",
                        help="shut a page's kernel down once no page has been connected to it, "
                             f"and it has done nothing, for SECONDS (default {CULL_AFTER}): a closed page frees its "
                             "memory (about 100 MB) within 1.25 x SECONDS; open pages keep theirs")
    parser.add_argument("--max-kernels", type=positive, default=MAX_KERNELS, metavar="N",
                        help=f"at most N pages (kernels) at once (default {MAX_KERNELS}, about "
                             "100 MB each); one more gets a page saying to close a tab and reload")


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
    cmd = voila_command(port, token, expose=args.expose, cull_after=args.cull_after,
                        max_kernels=args.max_kernels)
    if args.expose:
        print(EXPOSE_WARNING.format(port=port), file=sys.stderr, flush=True)
    urls = app_urls(port, token, expose=args.expose)
    where = "every network interface" if args.expose else "127.0.0.1 only"
    print(f"Starting the course's calculators (Voila, {where}) on port {port}; the URL follows "
          "once it answers (a few seconds).", flush=True)
    print(f"At most {args.max_kernels} pages at once (--max-kernels); a closed page's kernel is "
          f"shut down within {args.cull_after + cull_interval(args.cull_after)} s "
          "(--cull-after).", flush=True)

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
