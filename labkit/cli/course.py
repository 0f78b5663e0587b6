"""`labkit course`: JupyterLab on the course, bound to 127.0.0.1 with a token (what `make lab` runs).

The server opens (and prints the URL of) the welcome notebook, not the Launcher. It runs with
this environment first on the PATH, so `labkit` and `python` work in its notebooks (`!labkit ...`)
and in the terminals it opens, whatever the learner's ~/.bashrc puts in front. A configuration
directory of its own, on JUPYTER_CONFIG_PATH for this server only and removed when it stops,
carries the settings defaults below and the terminals' shell; the learner's own Jupyter
settings are never written.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

from labkit.course.outline import repo_root

WELCOME = "notebooks/00_welcome.ipynb"
# Settings defaults for this server only (a learner's own choice still wins): no "Would you like
# to get notified about official Jupyter news?" pop-up, no update check.
SETTING_DEFAULTS = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def port_number(text: str) -> int:
    """argparse type for --port: an integer from 0 (a free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = None
    if port is None or not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"--port={text} is not a port; allowed: 0 (any free port) to 65535")
    return port


def token_text(text: str) -> str:
    """--token: a non-empty token. An empty one would switch authentication off silently."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "--token='' would turn authentication off; allowed: a non-empty token, or leave "
            "--token out for a random one (--no-auth turns authentication off, with a warning)")
    return text


def bindable(host: str, port: int) -> bool:
    """Whether a Jupyter server could listen on host:port: bound as tornado binds (SO_REUSEADDR on
    POSIX), so a port left only in TIME-WAIT by a server that just stopped counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if os.name != "nt":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def pinned_port(requested: int, host: str = "127.0.0.1") -> int:
    """The port to serve on, chosen here (for --no-auth, whose warning names it): `requested`,
    or when it is taken the next free one up to 50 further (as Jupyter moves), or for 0 (or
    none free) one the system picks."""
    for port in range(requested, min(requested + 51, 65536)) if requested else ():
        if bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


NO_AUTH_WARNING = ("labkit course: WARNING: authentication is off (--no-auth). Any process or "
                   "user on this machine that can reach 127.0.0.1:{port} can run code as you.")


def lab_command(port: int | None = None, token: str | None = None, open_browser: bool = True,
                notebook: str = WELCOME, no_auth: bool = False) -> list[str]:
    """The JupyterLab command `make lab` runs: bound to 127.0.0.1 (never to the network), token
    authentication on (no_auth=True turns it off, and must be asked for), serving the checkout,
    opening `notebook` (its URL is the one printed)."""
    if token is not None and not str(token).strip():
        raise ValueError("token='' would turn authentication off; allowed: a non-empty token, "
                         "None for a random one, or no_auth=True to turn it off on purpose")
    if no_auth and token is not None:
        raise ValueError("token and no_auth=True contradict each other; allowed: one of them")
    if no_auth:
        token = ""
    root = repo_root()
    cmd = [sys.executable, "-m", "jupyterlab", notebook,
           f"--ServerApp.root_dir={root}", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port if port is not None else 8888}",
           f"--ServerApp.open_browser={bool(open_browser)}",
           f"--LabApp.default_url=/lab/tree/{urllib.parse.quote(notebook)}"]
    if token is not None:
        cmd.append(f"--IdentityProvider.token={token}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # cloud images often run as root; Jupyter refuses otherwise
    return cmd


def env_bin() -> str:
    """The bin directory of the environment labkit runs in (.venv/bin after `make lab`)."""
    return os.path.dirname(sys.executable)


def lab_env(config_dir: str | os.PathLike, base: dict | None = None) -> dict[str, str]:
    """The server's environment: this environment's bin first on PATH, VIRTUAL_ENV set when it
    is a virtual environment, and `config_dir` first on JUPYTER_CONFIG_PATH."""
    env = dict(os.environ if base is None else base)
    rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != env_bin()]
    env["PATH"] = os.pathsep.join([env_bin(), *rest])
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        p for p in (str(config_dir), env.get("JUPYTER_CONFIG_PATH")) if p)
    return env


def write_config(config_dir: str | os.PathLike, env: dict | None = None) -> None:
    """The course server's Jupyter configuration: settings defaults (labconfig) and, for its
    terminals, a shell started without `-l` (a login shell's /etc/profile resets PATH); bash
    reads the learner's ~/.bashrc and then puts this environment's bin first again."""
    env = os.environ if env is None else env
    root = Path(config_dir)
    (root / "labconfig").mkdir(parents=True, exist_ok=True)
    (root / "labconfig" / "default_setting_overrides.json").write_text(json.dumps(SETTING_DEFAULTS))
    shell = env.get("SHELL") or shutil.which("bash") or "sh"
    command = [shell]
    if os.path.basename(shell) == "bash":
        rc = root / "bashrc"
        rc.write_text("# written by `labkit course`: your ~/.bashrc, then the course's environment first\n"
                      'if [ -f "$HOME/.bashrc" ]; then . "$HOME/.bashrc"; fi\n'
                      f'export PATH={shlex.quote(env_bin())}:"$PATH"\n')
        command += ["--rcfile", str(rc)]
    server = {"ServerApp": {"terminado_settings": {"shell_command": command}}}
    (root / "jupyter_server_config.json").write_text(json.dumps(server, indent=1))


def add_arguments(parser) -> None:
    parser.add_argument("--port", type=port_number, default=8888,
                        help="port to serve on (default 8888; Jupyter tries the next ones if busy; 0 picks a free one)")
    parser.add_argument("--token", default=None, type=token_text,
                        help="token to require (default: Jupyter makes a random one and prints the URL with it)")
    parser.add_argument("--no-auth", action="store_true",
                        help="no token at all (prints a warning: any local process could use the server)")
    parser.add_argument("--no-browser", action="store_true", help="do not try to open a browser")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve(cmd: list[str], *, cwd, env, while_starting=None) -> int:
    """Run a Jupyter server (JupyterLab, Voila) in the foreground until it exits, Ctrl-C or
    SIGTERM (a service manager, a test, `kill`), which stop it the same way: SIGTERM to the
    server, which shuts its kernels down, and SIGKILL after 30 s. `while_starting(proc)` runs
    first (e.g. open a browser once the port answers). Returns the server's exit status, 0 when
    stopped."""
    signal.signal(signal.SIGTERM, _interrupt)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env)
    try:
        if while_starting is not None:
            while_starting(proc)
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        return 0


def run(args) -> int:
    if args.no_auth and args.token is not None:
        print("labkit course: --token and --no-auth contradict each other; allowed: one of them",
              file=sys.stderr)
        return 2
    # --no-auth: the port is chosen here and Jupyter kept on it, so the warning names the real one
    port = pinned_port(args.port) if args.no_auth else args.port
    cmd = lab_command(port=port, token=args.token, open_browser=not args.no_browser,
                      no_auth=args.no_auth)
    if args.no_auth:
        cmd.append("--ServerApp.port_retries=0")
        print(NO_AUTH_WARNING.format(port=port), file=sys.stderr, flush=True)
    print(f"Starting JupyterLab on the course (127.0.0.1 only): open the URL it prints, {WELCOME}")
    print("with its token. `labkit` works in its terminals (File > New > Terminal). Stop it with Ctrl-C.",
          flush=True)
    # SIGTERM stops the server the way Ctrl-C does (serve), so the config directory below is
    # removed instead of left in the temporary directory.
    with tempfile.TemporaryDirectory(prefix="labkit-course-") as config_dir:
        write_config(config_dir)
        return serve(cmd, cwd=repo_root(), env=lab_env(config_dir))
