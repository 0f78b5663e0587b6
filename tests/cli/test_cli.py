"""The `labkit` command's own odds and ends: --version, usage lines that name the subcommand,
`labkit bench` with no name, and multi-node arguments that cannot be right."""
from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT
from labkit.cli import main


def _labkit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True,
                          timeout=120)


def test_version_is_the_projects():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = _labkit("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"labkit {version}", r.stdout + r.stderr


@pytest.mark.parametrize("args", [["run", "-n", "two", "hello"], ["run", "hello", "-n", "two"]])
def test_run_usage_names_the_subcommand(args):
    """A bad option before or after the lab's name: the usage line is `labkit run`'s."""
    r = _labkit(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("usage: labkit run ") and " lab " in r.stderr.splitlines()[0] + r.stderr
    assert "labkit run: error: argument -n/--nproc-per-node/--nproc: invalid int value: 'two'" in r.stderr
    assert "__main__" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--node-rank", "5"], "--node-rank=5 is not a node of --nnodes=1; allowed: 0"),
    (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "127.0.0.1:1"],
     "--node-rank=-1 is not a node of --nnodes=2; allowed: 0 to 1"),
    (["--nnodes", "0"], "--nnodes=0 must be a whole number >= 1"),
])
def test_run_refuses_a_node_rank_outside_the_nodes(args, message, capsys):
    assert main(["run", "hello", *args]) == 2       # refused before torchrun starts
    assert f"labkit run: {message}" in capsys.readouterr().err


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    from labkit.cli.bench import _discover

    assert main(["bench"]) == 0
    out, err = capsys.readouterr()
    assert "required" not in out + err
    for name in _discover():
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [name])
        assert len(line.split()) > 2, f"{name} is listed without its help: {line!r}"
    assert "labkit bench all" in out


def test_run_refuses_too_many_ranks_and_names_its_flag(monkeypatch, capsys):
    """The refusal names `labkit run --oversubscribe`; that flag exists and reaches run_lab."""
    from labkit.runtime import launch, system
    monkeypatch.delenv("LABKIT_OVERSUBSCRIBE", raising=False)
    monkeypatch.setattr(system, "max_local_ranks", lambda: (4, "2 cores"))
    assert main(["run", "hello", "-n", "5"]) == 2
    err = capsys.readouterr().err
    assert "nproc=5 is more ranks than this machine holds" in err and "--oversubscribe" in err
    seen = {}

    def fake_run_lab(target, **kw):
        seen.update(kw)
        raise ValueError("stop here")
    monkeypatch.setattr(launch, "run_lab", fake_run_lab)
    assert main(["run", "hello", "-n", "5", "--oversubscribe"]) == 2
    assert seen["oversubscribe"] is True and seen["nproc"] == 5
