"""`labkit course`: JupyterLab on the course, bound to 127.0.0.1 with a token (what `make lab` runs)."""
from __future__ import annotations

import subprocess

from labkit.course import lab_command, repo_root


def add_arguments(parser) -> None:
    parser.add_argument("--port", type=int, default=8888,
                        help="port to serve on (default 8888; Jupyter tries the next ones if busy; 0 picks a free one)")
    parser.add_argument("--token", default=None,
                        help="token to require (default: Jupyter makes a random one and prints the URL with it)")
    parser.add_argument("--no-browser", action="store_true", help="do not try to open a browser")


def run(args) -> int:
    cmd = lab_command(port=args.port, token=args.token, open_browser=not args.no_browser)
    print("Starting JupyterLab on the course (127.0.0.1 only). Open the URL with the token that it prints;")
    print("stop it with Ctrl-C.", flush=True)
    try:
        return subprocess.call(cmd, cwd=repo_root())
    except KeyboardInterrupt:
        return 0
