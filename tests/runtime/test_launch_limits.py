"""run_lab's limits (issue 11, points 4-7): bad timeouts, more ranks than the machine holds,
unreadably long errors, run directories left by dead launchers, the collectives plot's path."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.runtime import launch, rundir, system
from labkit.runtime.launch import LabError, run_lab
from labkit.labs.collectives import save_plot

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"


@pytest.mark.parametrize("timeout", [math.inf, -math.inf, math.nan, 0, -1])
def test_timeout_must_be_finite_and_positive(timeout):
    with pytest.raises(ValueError, match="timeout") as info:
        run_lab("hello", nproc=2, timeout=timeout)
    assert "allowed" in str(info.value) or "> 0" in str(info.value)


def test_more_ranks_than_the_machine_holds_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(system, "max_local_ranks", lambda: (6, "2 cores"))
    monkeypatch.setattr(rundir, "make_run_dir", lambda run_id: pytest.fail("a run started"))
    with pytest.raises(ValueError) as info:
        run_lab("hello", nproc=7, timeout=60)
    text = str(info.value)
    assert "nproc=7" in text and "at most 6" in text and "2 cores" in text
    assert "oversubscribe=True" in text and "LABKIT_OVERSUBSCRIBE=1" in text
    monkeypatch.setenv("LABKIT_OVERSUBSCRIBE", "1")          # the override gets past the check
    with pytest.raises(BaseException) as info2:       # pytest.fail from the spy above
        run_lab("hello", nproc=7, timeout=60)
    assert "a run started" in str(info2.value)


def test_the_machine_limit_follows_cores_and_memory(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(system, "available_memory", lambda: 24e9)
    assert system.max_local_ranks() == (8, "2 cores")       # the 3D lab's 8 ranks fit a laptop
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert system.max_local_ranks()[0] == 60                 # memory bounds it: 24 GB / 400 MB
    monkeypatch.setattr(system, "available_memory", lambda: None)
    assert system.max_local_ranks() == (64, "16 cores")
    assert system.max_local_ranks()[0] < 1000


def test_a_huge_error_message_is_capped_and_kept_in_a_file():
    with pytest.raises(LabError) as info:
        run_lab(str(LABS / "raise_long.py"), nproc=1, timeout=120, quiet=True)
    text = str(info.value)
    assert len(text) <= rundir.MAX_MESSAGE_CHARS + 200
    assert text.startswith("lab ") and "rank 0 raised ValueError: line 0:" in text
    path = text.split("the whole message: ")[1].split(")")[0]
    try:
        full = Path(path).read_text()
        assert "line 4999: " in full and len(full) > 300_000
    finally:
        os.unlink(path)


def test_cap_message_leaves_short_messages_alone():
    assert rundir.cap_message("rank 1 raised ValueError: no", "r") == "rank 1 raised ValueError: no"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_run_directories_are_swept_and_live_ones_kept(tmp_path):
    def run_dir(name, owner=None, age=0.0):
        d = tmp_path / f"labkit-{name}-abcd"
        (d / "results").mkdir(parents=True)
        if owner is not None:
            (d / "owner.json").write_text(json.dumps(owner))
        if age:
            old = time.time() - age
            os.utime(d, (old, old))
        return d

    dead = run_dir("dead", {"pid": _dead_pid(), "start": None})
    mine = run_dir("mine", {"pid": os.getpid(), "start": None})
    reused = run_dir("reused", {"pid": os.getpid(), "start": "1"})   # same pid, another start
    legacy_old = run_dir("legacyold", age=2 * rundir.LEGACY_AGE_SECONDS)
    legacy_new = run_dir("legacynew")
    target = tmp_path / "precious"
    target.mkdir()
    (tmp_path / "labkit-link-abcd").symlink_to(target)
    other = tmp_path / "labkit-notarun-x"
    other.mkdir()                                                    # no results/, no owner
    removed = {Path(p).name for p in rundir.sweep_stale(str(tmp_path))}
    assert removed == {dead.name, reused.name, legacy_old.name}
    assert mine.exists() and legacy_new.exists() and target.exists() and other.exists()


def test_run_lab_makes_an_owned_run_dir_and_removes_it(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / "labkit-old-zzzz"
    (stale / "results").mkdir(parents=True)
    (stale / "owner.json").write_text(json.dumps({"pid": _dead_pid(), "start": None}))
    seen = []
    real = rundir.make_run_dir

    def spy(run_id):
        path = real(run_id)
        seen.append(json.loads((Path(path) / "owner.json").read_text()))
        return path
    monkeypatch.setattr(launch.rundir, "make_run_dir", spy)
    run_lab("hello", nproc=1, timeout=120, quiet=True)
    assert not stale.exists(), "the next run sweeps what a dead launcher left"
    assert seen and seen[0]["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("labkit-")] == []


def test_collectives_plot_goes_to_a_private_dir_and_never_through_a_symlink(tmp_path):
    path = Path(save_plot(b"\x89PNG fake", "auto"))
    try:
        assert path.read_bytes() == b"\x89PNG fake"
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert path.parent.name.startswith("labkit-collectives-")
    finally:
        path.unlink()
        path.parent.rmdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "plot.png"
    link.symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link is refused"):
        save_plot(b"png", str(link))
    assert victim.read_text() == "keep me"
    plain = tmp_path / "mine.png"
    assert save_plot(b"png", str(plain)) == str(plain) and plain.read_bytes() == b"png"


@pytest.mark.parametrize("node_rank", [5, -1, 2, 1.5])
def test_node_rank_must_be_a_node(node_rank):
    with pytest.raises(ValueError, match=f"node_rank={node_rank!r} is not a node of nnodes=2"):
        run_lab("hello", nproc=1, nnodes=2, node_rank=node_rank, rdzv_endpoint="127.0.0.1:1")
