"""Install the pinned torch before labkit: the CPU build where there is no NVIDIA GPU.

Run by the Makefile's set-up with the virtual environment's Python, before labkit exists, so
it uses the standard library only:

    .venv/bin/python tools/torch_install.py torch==2.13.0            # install
    .venv/bin/python tools/torch_install.py torch==2.13.0 --dry-run  # print the pip command only

Which index pip gets:
- TORCH_INDEX_URL set: that index (TORCH_INDEX_URL=default: pip's own index, as configured);
- an NVIDIA GPU (`nvidia-smi -L` succeeds, or /proc/driver/nvidia exists): pip's own index,
  whose Linux wheel is the CUDA build;
- macOS and Windows: pip's own index (its wheels there are already CPU / MPS builds);
- Linux without an NVIDIA GPU: PyTorch's CPU wheel index (about 200 MB instead of the CUDA
  build's several GB of nvidia packages), or pip's own index when that index does not answer
  within a few seconds (offline mirrors, firewalls): the pin is installed either way.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Callable

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT = 5.0     # seconds: the whole probe, name lookup included
DEFAULT = "default"     # TORCH_INDEX_URL=default: pip's own index


def has_nvidia_gpu(proc_dir: str = "/proc/driver/nvidia") -> bool:
    """An NVIDIA driver is loaded: its /proc entry exists or `nvidia-smi -L` lists a GPU."""
    if os.path.isdir(proc_dir):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and "GPU" in r.stdout


def index_reachable(url: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the index's torch page answers within `timeout` seconds (a slow name lookup
    counts against it too: the request runs in a thread that is abandoned at the limit)."""
    answer: list[bool] = []

    def probe() -> None:
        try:
            # GET, not HEAD (some mirrors refuse HEAD); the body is never read
            with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as r:
                answer.append(200 <= r.status < 400)
        except (OSError, ValueError):   # URLError, HTTPError, timeouts, a malformed URL
            answer.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(answer and answer[0])


def choose_index(system: str, gpu: Callable[[], bool], reachable: Callable[[str], bool],
                 override: str | None = None) -> tuple[str | None, str]:
    """(index URL for pip, or None for pip's own index; why). `gpu` and `reachable` are only
    called when the answer depends on them."""
    if override:
        if override == DEFAULT:
            return None, "TORCH_INDEX_URL=default: pip's own index"
        return override, f"TORCH_INDEX_URL={override}"
    if system != "Linux":
        return None, f"{system}: pip's own index has the CPU build"
    if gpu():
        return None, "an NVIDIA GPU is present: the CUDA build from pip's own index"
    if reachable(CPU_INDEX):
        return CPU_INDEX, "no NVIDIA GPU: the CPU build from PyTorch's CPU index"
    return None, (f"no NVIDIA GPU, but {CPU_INDEX} could not be reached (refused, or no answer "
                  f"within {PROBE_TIMEOUT:.0f} s): "
                  "pip's own index (set TORCH_INDEX_URL to choose another)")


def pip_command(python: str, pin: str, index: str | None) -> list[str]:
    cmd = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if index is not None:
        cmd += ["--index-url", index]
    return cmd + [pin]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torch_install.py", description=__doc__.split("\n")[0])
    parser.add_argument("pin", help="the requirement to install, e.g. torch==2.13.0")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command, do not run it")
    args = parser.parse_args(argv)
    if not args.pin.startswith("torch=="):
        parser.error(f"pin={args.pin!r} is not an exact torch pin; expected torch==X.Y.Z")
    index, why = choose_index(platform.system(), has_nvidia_gpu, index_reachable,
                              os.environ.get("TORCH_INDEX_URL"))
    cmd = pip_command(sys.executable, args.pin, index)
    print(f">> {args.pin}: {why}", flush=True)
    print("   " + " ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    code = subprocess.call(cmd)
    if code:
        print(f"torch_install.py: pip failed (exit {code}); to pick the index yourself, set "
              f"TORCH_INDEX_URL (an index URL, or 'default' for pip's own)", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
