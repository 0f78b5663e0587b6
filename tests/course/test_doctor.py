"""`labkit doctor`: the report on this machine, its JSON form, and that missing pieces fail."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from labkit.course import doctor
from labkit.runtime import system
from labkit.cli import doctor as doctor_cmd

EXPECTED = ["python", "torch", "gpus", "gpu topology", "gloo", "nccl", "cpu cores", "ram",
            "course memory", "lab defaults", "jupyterlab", "ipywidgets", "widgets extension",
            "free port"]


def _args(**kw):
    base = dict(json=False, no_launch=True, nproc=2, timeout=120.0)
    base.update(kw)
    return argparse.Namespace(**base)


def test_report_on_this_machine_is_ready():
    report = doctor.run_checks(launch=False)
    assert [c.name for c in report.checks] == EXPECTED
    assert report.ok, report.text()
    import torch
    assert torch.__version__ in report["torch"].detail
    assert report["cpu cores"].data["cores"] == len(os.sched_getaffinity(0))
    assert report["lab defaults"].data["backend"] in ("gloo", "nccl")


def test_json_output_is_machine_readable():
    r = subprocess.run([sys.executable, "-m", "labkit", "doctor", "--json", "--no-launch"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["ok"] is True
    assert [c["name"] for c in data["checks"]] == EXPECTED
    assert all(c["status"] in ("ok", "info", "warn", "fail") for c in data["checks"])


def test_missing_widgets_extension_fails_with_a_fix(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "WIDGETS_EXTENSION", "@jupyter-widgets/not-installed")
    assert doctor_cmd.run(_args()) == 1
    out = capsys.readouterr().out
    assert "[FAIL] widgets extension" in out
    assert "Not ready: 1 missing piece(s)" in out and "pip install" in out


def test_old_python_fails(monkeypatch):
    monkeypatch.setattr(doctor, "MIN_PYTHON", (99, 0))
    check = doctor.check_python()
    assert check.status == "fail" and "99.0" in check.fix


def test_topology_is_shown_when_nvidia_smi_exists(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '        GPU0    GPU1'\necho 'GPU0     X      NV18'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    check = doctor.check_topology()
    assert check.status == "ok" and "NV18" in check.detail


def test_a_failing_nvidia_smi_is_a_warning_with_its_error(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch' >&2\nexit 9\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    check = doctor.check_topology()
    assert check.status == "warn"
    assert "nvidia-smi topo -m exited 9" in check.detail and "version mismatch" in check.detail
    assert doctor.nvidia_smi("topo", "-m") == (None, check.detail)


def test_bad_nproc_is_refused_on_stderr(capsys):
    assert doctor_cmd.run(_args(nproc=1)) == 2
    out, err = capsys.readouterr()
    assert "labkit doctor: --nproc=1 is too small; a collective needs at least 2 ranks" in err
    assert out == ""


@pytest.mark.multirank
def test_two_ranks_start_and_all_reduce(monkeypatch):
    monkeypatch.delenv("LABKIT_LAUNCHER", raising=False)     # the default, "auto"
    check = doctor.check_launch(nproc=2, timeout=120)
    assert check.status == "ok", check.detail
    assert check.data["seconds"] > 0 and check.data["backend"] == "gloo"
    # the warm pool keeps its rendezvous store on loopback (issue 12)
    assert check.data["launcher"] == "pool" and "from the warm pool" in check.detail
    assert doctor.check_exposure(check).status == "ok"
    # torchrun's binds every interface (issue 11, point 3): the doctor says so
    check = doctor.check_launch(nproc=2, timeout=120, launcher="torchrun")
    assert check.status == "ok" and check.data["launcher"] == "torchrun", check.detail
    listens = [tuple(s) for s in check.data["launcher_listens"]]
    assert listens, "the hello lab reports what torchrun listens on"
    for var in doctor.MULTI_NODE_VARS:
        monkeypatch.delenv(var, raising=False)
    ports = doctor.check_exposure(check)
    if system.exposed(listens):              # one machine: information (issue 28, item 12)
        assert ports.status == "info" and "every interface" in ports.detail
        monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")       # a node of a multi-node job
        ports = doctor.check_exposure(check)
        assert ports.status == "warn" and "every interface" in ports.detail and ports.fix
        assert "what to do:" in doctor.Report([ports]).text()
    else:                                    # a launcher that keeps to loopback (issue 12)
        assert ports.status == "ok"


def test_exposure_check_reads_what_the_launch_saw(monkeypatch):
    from labkit.course.doctor import Check
    for var in doctor.MULTI_NODE_VARS:
        monkeypatch.delenv(var, raising=False)
    seen = Check("2-rank launch", "ok", "", data={"launcher_listens": [["::", 4000], ["127.0.0.1", 4001]]})
    # one machine (a laptop): information, not a warning, with the advice in its detail
    info = doctor.check_exposure(seen)
    assert info.status == "info" and "[::]:4000" in info.detail and "4001" not in info.detail
    assert "ufw default deny incoming" in info.detail
    assert "[WARN]" not in doctor.Report([info]).text()
    # a node of a multi-node job: the warning and what to do
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    warn = doctor.check_exposure(seen)
    assert warn.status == "warn" and "[::]:4000" in warn.detail and "4001" not in warn.detail
    assert "SLURM_JOB_NUM_NODES=4" in warn.detail and "ufw" in warn.fix
    quiet = Check("2-rank launch", "ok", "", data={"launcher_listens": [["127.0.0.1", 4001], ["::1", 4002]]})
    assert doctor.check_exposure(quiet).status == "ok"
    assert doctor.check_exposure(Check("2-rank launch", "fail", "")).status == "info"


def test_listening_sockets_are_read_from_proc():
    import socket
    everywhere, loopback = socket.socket(), socket.socket()
    try:
        everywhere.bind(("0.0.0.0", 0))
        loopback.bind(("127.0.0.1", 0))
        everywhere.listen()
        loopback.listen()
        mine = system.listening_sockets(os.getpid())
        wide, local = everywhere.getsockname()[1], loopback.getsockname()[1]
        assert ("0.0.0.0", wide) in mine and ("127.0.0.1", local) in mine
        assert system.exposed(mine) == [s for s in mine if s[0] != "127.0.0.1"]
        assert ("0.0.0.0", wide) in system.exposed(mine)
    finally:
        everywhere.close()
        loopback.close()


def _fake_run_lab(results=None, error=None):
    from types import SimpleNamespace

    def run_lab(target, nproc, timeout, quiet):
        assert target == "labkit.labs.hello" and quiet
        if error:
            raise error
        return SimpleNamespace(results=results)
    return run_lab


def test_launch_check_fails_on_a_wrong_all_reduce(monkeypatch):
    import labkit.runtime.launch
    wrong = [{"all_reduce": 2.0, "backend": "gloo"}, {"all_reduce": 3.0, "backend": "gloo"}]
    monkeypatch.setattr(labkit.runtime.launch, "run_lab", _fake_run_lab(wrong))
    check = doctor.check_launch(nproc=2)
    assert check.status == "fail"
    assert "[2.0, 3.0]" in check.detail and "expected 3" in check.detail


def test_launch_check_fails_when_the_lab_fails(monkeypatch):
    import labkit.runtime.launch
    err = labkit.runtime.launch.LabError("rank 1 raised RuntimeError: no route\ntraceback...", reason="exception")
    monkeypatch.setattr(labkit.runtime.launch, "run_lab", _fake_run_lab(error=err))
    check = doctor.check_launch(nproc=2)
    assert check.status == "fail" and "rank 1 raised RuntimeError: no route" in check.detail
    assert "labkit run hello -n 2" in check.fix


def test_one_machine_or_one_node_of_several():
    assert doctor.multi_node({}) is None
    assert doctor.multi_node({"SLURM_JOB_NUM_NODES": "1", "PET_NNODES": "1:1"}) is None
    assert doctor.multi_node({"SLURM_NNODES": "2"}) == "SLURM_NNODES=2"
    assert doctor.multi_node({"PET_NNODES": "1:4"}) == "PET_NNODES=1:4"
    assert doctor.multi_node({"SLURM_JOB_NUM_NODES": "many"}) is None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_course_memory_shows_what_kernels_and_warm_pools_hold(tmp_path, monkeypatch):
    """Issue 28, item 7: the course's kernels (started in the checkout) and warm pools, with
    what they hold; a kernel of another folder is not the course's."""
    from labkit.runtime import pool

    monkeypatch.delenv("LABKIT_POOL_IDLE_TIMEOUT", raising=False)

    course, elsewhere = tmp_path / "course", tmp_path / "elsewhere"
    (course / "notebooks").mkdir(parents=True)
    elsewhere.mkdir()
    script = tmp_path / "ipykernel_launcher.py"          # stands in for `python -m ipykernel`
    script.write_text("import time\ntime.sleep(120)\n")
    kernels = [subprocess.Popen([sys.executable, str(script), "-f", "kernel.json"], cwd=where)
               for where in (course / "notebooks", elsewhere)]
    try:
        warm = pool.warm(wait=True) if pool.supported() else None
        found = doctor.course_processes(course)
        assert [k["pid"] for k in found["kernels"]] == [kernels[0].pid]
        assert found["kernels"][0]["bytes"] > 1e6 and found["kernels"][0]["kind"] in ("PSS", "RSS")
        if warm is not None:
            mine = [p for p in found["pools"] if p["pid"] == warm.proc.pid]
            assert mine and mine[0]["bytes"] > 10e6, found["pools"]   # it has imported torch
        check = doctor.check_course_memory(course)
        assert check.status == "info" and "1 Jupyter kernel " in check.detail
        assert "Shut Down Kernel" in check.detail and "leaves after 10 min" in check.detail
    finally:
        for k in kernels:
            k.kill()
            k.wait()
