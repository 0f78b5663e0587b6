"""`labkit course`: JupyterLab on the course, bound to 127.0.0.1 with a token (what `make lab` runs)."""
from __future__ import annotations

import os
import subprocess
import sys

from labkit.course.outline import repo_root


def lab_command(port: int | None = None, token: str | None = None, open_browser: bool = True,
                notebook: str = "notebooks/00_welcome.ipynb") -> list[str]:
    """The JupyterLab command `make lab` runs: bound to 127.0.0.1 (never to the network), token
    authentication on, serving the checkout, opening the welcome notebook."""
    root = repo_root()
    cmd = [sys.executable, "-m", "jupyterlab", notebook,
           f"--ServerApp.root_dir={root}", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port if port is not None else 8888}",
           f"--ServerApp.open_browser={bool(open_browser)}"]
    if token is not None:
        cmd.append(f"--IdentityProvider.token={token}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # cloud images often run as root; Jupyter refuses otherwise
    return cmd


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
