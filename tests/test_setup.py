"""The set-up's torch choice (tools/torch_install.py, run by the Makefile before labkit exists):
the CPU build on Linux without an NVIDIA GPU, the CUDA build with one, pip's own index when
PyTorch's CPU index cannot be reached, and no network is touched here."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tools" / "torch_install.py"


@pytest.fixture(scope="module")
def ti():
    spec = importlib.util.spec_from_file_location("torch_install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _never(*_):
    raise AssertionError("this probe must not run for this choice")


def test_linux_without_gpu_gets_the_cpu_index(ti):
    index, why = ti.choose_index("Linux", gpu=lambda: False, reachable=lambda url: True)
    assert index == ti.CPU_INDEX and "CPU" in why
    assert ti.pip_command("py", "torch==2.13.0", index)[-3:] == ["--index-url", ti.CPU_INDEX, "torch==2.13.0"]


def test_linux_with_gpu_gets_pips_own_index(ti):
    index, why = ti.choose_index("Linux", gpu=lambda: True, reachable=_never)
    assert index is None and "GPU" in why
    assert "--index-url" not in ti.pip_command("py", "torch==2.13.0", index)


def test_unreachable_cpu_index_falls_back_to_pips_own_index(ti):
    asked = []
    index, why = ti.choose_index("Linux", gpu=lambda: False, reachable=lambda url: asked.append(url) or False)
    assert index is None and asked == [ti.CPU_INDEX] and "could not be reached" in why
    assert ti.pip_command("py", "torch==2.13.0", index)[-1] == "torch==2.13.0"


def test_macos_and_the_override(ti):
    assert ti.choose_index("Darwin", gpu=_never, reachable=_never)[0] is None
    assert ti.choose_index("Linux", _never, _never, override="https://mirror/simple")[0] == "https://mirror/simple"
    assert ti.choose_index("Linux", _never, _never, override="default")[0] is None


def test_gpu_detection(ti, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))           # no nvidia-smi on the PATH
    assert not ti.has_nvidia_gpu(proc_dir=str(tmp_path / "absent"))
    assert ti.has_nvidia_gpu(proc_dir=str(tmp_path))    # the driver's /proc entry exists
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    assert ti.has_nvidia_gpu(proc_dir=str(tmp_path / "absent"))
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    assert not ti.has_nvidia_gpu(proc_dir=str(tmp_path / "absent"))


def test_probe_of_an_unreachable_index_is_quick(ti):
    with socket.socket() as s:              # a local port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert not ti.index_reachable(f"http://127.0.0.1:{port}/whl/cpu", timeout=5)
    assert not ti.index_reachable("not a url", timeout=5)
    assert time.monotonic() - start < 10


def test_makefile_installs_torch_through_the_script():
    """The Makefile's set-up recipe, printed by make without running it, calls the script with
    the pin; the script's dry run prints the pip command it would run (no network here:
    TORCH_INDEX_URL fixes the index)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = subprocess.run(["make", "-n", "-B", ".venv/.labkit-installed"], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    line = next(ln for ln in r.stdout.splitlines() if "torch_install.py" in ln)
    pin = re.search(r'"(torch==[\d.]+)"', line).group(1)
    assert re.search(r"TORCH_PIN\s*:=\s*" + re.escape(pin), (ROOT / "Makefile").read_text())
    env = dict(os.environ, TORCH_INDEX_URL="https://mirror.example/simple")
    out = subprocess.run([sys.executable, str(SCRIPT), pin, "--dry-run"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert f"-m pip install --disable-pip-version-check --index-url https://mirror.example/simple {pin}" in out
    r = subprocess.run([sys.executable, str(SCRIPT), "torch", "--dry-run"], capture_output=True, text=True)
    assert r.returncode == 2 and "pin='torch'" in r.stderr


def test_make_grade_runs_labkit_grade_from_the_environment():
    """`make grade NB=...` works from a shell where `labkit` is not on the PATH; without NB it
    says what to type, before any set-up."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    nb = "exercises/01_memory_math.ipynb"
    r = subprocess.run(["make", "-n", "grade", f"NB={nb}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and f'.venv/bin/python -m labkit grade "{nb}"' in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["make", "grade"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"NB is missing; e.g. make grade NB={nb}" in r.stderr
    assert "pip install" not in r.stdout
