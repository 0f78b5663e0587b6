"""Instructor tools (issue 21): `labkit workshop check` (a room's preflight), `labkit workshop
budget` (GPU-hours from measured lab times) and `labkit reset` (a fresh exercise notebook).

The preflight runs for real here (CPU: its GPU rows must be skipped with a reason, and at least
two labs launched and timed); its GPU paths are driven with recorded `nvidia-smi topo -m`
matrices and a stand-in for the NCCL lab's report, since no GPU is lent to CI."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import topology
from labkit.course import workshop

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def labkit_cmd(name: str) -> list[str]:
    """`labkit NAME` once cli/__init__ lists it, else the command's module run directly."""
    from labkit.cli import COMMANDS
    if name in COMMANDS:
        return [sys.executable, "-m", "labkit", name]
    return [sys.executable, "-m", f"labkit.cli.{name}"]


def cli(name: str, *args: str, timeout: float = 240, stdin=subprocess.DEVNULL, cwd=ROOT):
    return subprocess.run([*labkit_cmd(name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, stdin=stdin,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def run_main(capsys, name: str, *args: str):
    """The same command in this process (no interpreter start): (exit code, stdout, stderr)."""
    import importlib
    from labkit.cli import COMMANDS, main
    argv = list(args)
    code = main([name, *argv]) if name in COMMANDS else \
        importlib.import_module(f"labkit.cli.{name}").main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# --- the preflight, for real --------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_report():
    out = cli("workshop", "check", "--quick", "--json")
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout), out


@pytest.mark.multirank
@pytest.mark.slow
def test_check_json_gives_a_verdict_and_lab_times(quick_report):
    report, out = quick_report
    assert out.returncode == (0 if report["ok"] else 1)
    assert report["verdict"].startswith(report["host"] + ": ")
    assert ("READY" in report["verdict"]) and (("NOT READY" in report["verdict"]) != report["ok"])
    labs = [c for c in report["checks"] if c["data"].get("lab")]
    expected = [r.name for r in workshop.select_labs(quick=True)]
    assert [c["data"]["lab"] for c in labs] == expected and len(expected) >= 2
    assert all(c["status"] == "ok" for c in labs), labs
    # every lab launched and timed: its time lies inside the whole run's, and they add up
    times = report["lab_seconds"]
    assert set(times) == set(expected)
    assert all(0 < s < report["seconds"] for s in times.values())
    assert sum(times.values()) < report["seconds"]
    assert f"{len(times)}/{len(expected)} labs ran" in report["verdict"]
    ranks = {c["data"]["lab"]: c["data"]["nproc"] for c in labs}
    assert ranks == {r.name: r.nproc for r in workshop.select_labs(quick=True)}
    assert {c["name"] for c in report["checks"]} >= {"gpus", "nccl", "interconnect",
                                                      "all-reduce busbw", "disk"}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.skipif(has_cuda(), reason="the CPU verdict; this machine has CUDA")
def test_cpu_machine_skips_gpu_checks_with_a_reason(quick_report):
    report, _ = quick_report
    rows = {c["name"]: c for c in report["checks"]}
    for name in ("gpus", "nccl", "interconnect", "all-reduce busbw"):
        assert rows[name]["status"] == "skip", rows[name]
        assert "no CUDA" in rows[name]["detail"] and rows[name]["data"]["skipped"]
    assert report["gpus"] == 0
    assert "CPU-only: labs run over gloo; GPU checks skipped (no CUDA)" in report["verdict"]
    labs = [c for c in report["checks"] if c["data"].get("lab") and c["data"]["nproc"] > 1]
    assert labs and all(c["data"]["backend"] == "gloo" for c in labs)


@pytest.mark.multirank
def test_check_text_ends_with_the_verdict():
    out = cli("workshop", "check", "--labs", "hello")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert "lab 00 hello" in out.stdout and "READY" in lines[-1]
    assert "1/1 labs ran" in lines[-1]


def test_check_refuses_bad_arguments(capsys):
    code, _, err = run_main(capsys, "workshop", "check", "--labs", "hello,warp-drive")
    assert code == 2
    assert "'warp-drive' is not a course lab" in err and "allowed:" in err
    assert "ddp:compare" in err
    code, _, err = run_main(capsys, "workshop", "check", "--nproc", "1")
    assert code == 2 and "allowed: 2 to 64" in err
    code, _, err = run_main(capsys, "workshop")
    assert code == 2 and "allowed: check, budget" in err


def test_select_labs_by_run_lab_module_and_what_they_need():
    assert [r.name for r in workshop.select_labs("ddp:compare")] == ["ddp:compare"]
    assert {r.lab for r in workshop.select_labs("ddp")} == {"ddp"}
    assert len(workshop.select_labs("ddp")) == sum(r.lab == "ddp" for r in workshop.COURSE_LABS)
    # a resume reads the crashed run's checkpoints: the crash comes first
    assert [r.name for r in workshop.select_labs("checkpoint:resume")] == [
        "checkpoint:crash", "checkpoint:resume"]
    assert {r.module for r in workshop.select_labs("06")} == {"06"}
    assert len(workshop.select_labs("all")) == len(workshop.COURSE_LABS)
    default = workshop.select_labs()
    assert len({r.lab for r in default}) == len(default)     # one run per lab program
    assert {r.lab for r in default} == {r.lab for r in workshop.COURSE_LABS}


def test_every_course_lab_run_names_a_lab_and_its_notebook_calls_it():
    from labkit.runtime.launch import available_labs
    labs = set(available_labs())
    for r in workshop.COURSE_LABS:
        assert r.lab in labs, r
        nb = next(ROOT.glob(f"notebooks/{r.module}_*.ipynb"))
        assert f"labkit.labs.{r.lab}" in nb.read_text(), (r, nb)
        for need in r.needs:
            assert workshop.COURSE_LABS.index(workshop._BY_NAME[need]) < \
                workshop.COURSE_LABS.index(r)


# --- GPU paths, with recorded outputs ------------------------------------------------------------

DGX_H100 = ("\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-55\t0\t\tN/A\n"
            "GPU1\tNV18\t X \tNV18\tNV18\tSYS\t0-55\t0\t\tN/A\n"
            "GPU2\tNV18\tNV18\t X \tNV18\tSYS\t56-111\t1\t\tN/A\n"
            "GPU3\tNV18\tNV18\tNV18\t X \tSYS\t56-111\t1\t\tN/A\n\nLegend:\n\n  X    = Self\n"
            "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA "
            "nodes (e.g., QPI/UPI)\n  NV#  = Connection traversing a bonded set of # NVLinks\n")
PCIE_BOX = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tPIX\tSYS\t0-15\t0\n"
            "GPU1\tPIX\t X \tSYS\t0-15\t0\n"
            "GPU2\tSYS\tSYS\t X \t16-31\t1\n")


def test_topology_is_parsed_and_the_slowest_path_found():
    t = topology.parse_topology(DGX_H100)
    assert t["gpus"] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert len(t["pairs"]) == 6 and set(t["pairs"].values()) == {"NV18"}   # NICs left out
    assert t["slowest"] == "NV18"
    p = topology.parse_topology(PCIE_BOX)
    assert p["pairs"] == {"GPU0-GPU1": "PIX", "GPU0-GPU2": "SYS", "GPU1-GPU2": "SYS"}
    assert p["slowest"] == "SYS"
    assert topology.parse_topology("No devices were found")["slowest"] is None


def test_expected_bus_bandwidth_from_the_link():
    # independent figures: NVLink 4 and 3 carry 25 GB/s per link per direction (H100: 18 links,
    # 900 GB/s both ways; A100: 12 links, 600 GB/s); PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b
    bw, why = topology.expected_busbw("NV18", "NVIDIA H100 80GB HBM3")
    assert bw == pytest.approx(18 * 25 * GB) and "NV18" in why
    assert topology.expected_busbw("NV12", "NVIDIA A100-SXM4-80GB")[0] == pytest.approx(300 * GB)
    assert topology.expected_busbw("NV4", "NVIDIA A100-SXM4-40GB")[0] == pytest.approx(100 * GB)
    pcie4 = 16e9 * 16 * (128 / 130) / 8
    assert topology.expected_busbw("PIX", "NVIDIA L4", 4, 16)[0] == pytest.approx(pcie4)
    assert topology.expected_busbw("SYS", "NVIDIA L4", 4, 8)[0] == pytest.approx(pcie4 / 2)
    bw, why = topology.expected_busbw("PIX", "Tesla T4", 3, 16)     # no PCIe 3 in the table
    assert bw is None and "gen 3" in why
    assert topology.expected_busbw("NV2", "Quadro RTX 8000")[0] is None
    assert topology.expected_busbw(None, "NVIDIA H100")[0] is None


def test_busbw_check_compares_the_measurement_with_the_link(monkeypatch):
    import labkit.runtime.launch as launch
    from labkit.comm import bus_bandwidth
    from labkit.course.doctor import Check

    size, seconds = 256 * 2**20, 1.2e-3
    calls = []

    class Fake:
        results = [{"backend": "nccl", "rows": [dict(
            op="all_reduce", size=size, algbw=size / seconds,
            busbw=bus_bandwidth("all_reduce", size, seconds, 4))]}]
        launcher = "pool"

    def fake_run_lab(target, **kw):
        calls.append((target, kw))
        return Fake

    monkeypatch.setattr(launch, "run_lab", fake_run_lab)
    inter = Check("interconnect", "ok", "", data={"expected_busbw": 450 * GB, "link": "NV18"})
    c = workshop.check_busbw(4, inter)
    busbw = size / seconds * 2 * 3 / 4                    # all-reduce: algbw x 2(n-1)/n
    assert calls[0][0] == "labkit.labs.collectives" and calls[0][1]["nproc"] == 4
    assert calls[0][1]["env"] == {"LABKIT_BACKEND": "nccl"}
    assert c.data["busbw"] == pytest.approx(busbw)
    assert c.data["share"] == pytest.approx(busbw / (450 * GB))
    assert c.status == ("ok" if busbw / (450 * GB) >= topology.BUSBW_OK_SHARE else "warn")
    slow = Check("interconnect", "ok", "", data={"expected_busbw": 4 * busbw, "link": "NV18"})
    s = workshop.check_busbw(4, slow)
    assert s.status == "warn" and "peer-to-peer" in s.fix and "25%" in s.detail
    assert workshop.check_busbw(1, inter).status == "skip"


def test_disk_check_fails_when_full(monkeypatch, tmp_path):
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    for free, status in ((0.5 * GB, "fail"), (3 * GB, "warn"), (50 * GB, "ok")):
        monkeypatch.setattr(workshop.shutil, "disk_usage", lambda p, f=free: usage(1, 1, f))
        assert workshop.check_disk({"course": str(tmp_path)}).status == status


# --- the budget -----------------------------------------------------------------------------------

def test_gpu_hours_against_a_hand_computation():
    times = {"hello": 1.5, "ddp:compare": 40.0, "threed:3d": 120.25}
    b = workshop.gpu_hours(30, times, gpus_per_learner=4, repeats=2, session_hours=6,
                           price_per_gpu_hour=2.5)
    # 30 learners x 4 GPUs x 161.75 s x 2 runs = 38,820 GPU-seconds = 10.783 GPU-hours
    assert b.lab_seconds == pytest.approx(161.75)
    assert b.compute_gpu_hours == pytest.approx(38820 / 3600)
    assert b.reserved_gpu_hours == pytest.approx(720)           # 30 x 4 x 6 h
    assert b.cost == pytest.approx(1800)                         # the billed hours x 2.5
    assert sum(r["gpu_hours"] for r in b.rows) == pytest.approx(b.compute_gpu_hours)
    assert workshop.gpu_hours(1, {"a": 3600}).compute_gpu_hours == pytest.approx(1)
    assert workshop.gpu_hours(2, {"a": 1800}, price_per_gpu_hour=3).cost == pytest.approx(3)


@pytest.mark.parametrize("kwargs, words", [
    (dict(learners=0, lab_seconds={"a": 1}), "learners"),
    (dict(learners=2.5, lab_seconds={"a": 1}), "learners"),
    (dict(learners=3, lab_seconds={}), "non-empty"),
    (dict(learners=3, lab_seconds={"a": -1}), "lab_seconds['a']"),
    (dict(learners=3, lab_seconds={"a": 1}, gpus_per_learner=0), "gpus_per_learner"),
    (dict(learners=3, lab_seconds={"a": 7200}, session_hours=1), "shorter than the labs"),
])
def test_gpu_hours_refuses_bad_input(kwargs, words):
    with pytest.raises(ValueError, match="allowed|must"):
        try:
            workshop.gpu_hours(**kwargs)
        except ValueError as exc:
            assert words in str(exc), exc
            raise


def test_budget_cli_reads_a_check_report(tmp_path, capsys):
    report = tmp_path / "node.json"
    report.write_text(json.dumps({"host": "gpu-7", "gpus": 4,
                                  "lab_seconds": {"hello": 2.0, "zero": 70.0}}))
    out = cli("workshop", "budget", "--learners", "10", "--gpus-per-learner", "4", "--times",
              str(report), "--repeats", "3", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["compute_gpu_hours"] == pytest.approx(10 * 4 * 72 * 3 / 3600)
    code, text, _ = run_main(capsys, "workshop", "budget", "--learners", "10", "--times",
                             str(report))
    assert code == 0 and "gpu-7" in text and "GPU-hours" in text
    code, _, err = run_main(capsys, "workshop", "budget", "--learners", "10", "--times",
                            str(tmp_path / "nope.json"))
    assert code == 2 and "is not a `labkit workshop check --json` report" in err
    code, _, err = run_main(capsys, "workshop", "budget", "--learners", "-3", "--times",
                            str(report))
    assert code == 2 and "learners" in err


# --- reset ----------------------------------------------------------------------------------------

NAME = "02_collectives.ipynb"


@pytest.fixture
def course(tmp_path):
    """A course folder of its own (the checkout's exercises/ are other people's work)."""
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    shutil.copy(ROOT / "solutions" / NAME, tmp_path / "solutions" / NAME)
    shutil.copy(ROOT / "exercises" / NAME, tmp_path / "exercises" / NAME)
    return tmp_path


def test_reset_backs_up_and_restores(course):
    from labkit.course.exercises import render_path
    target = course / "exercises" / NAME
    fresh = render_path(course / "solutions" / NAME)
    mine = target.read_text().replace("raise NotImplementedError", "answer = 42  #", 1)
    assert mine != fresh
    target.write_text(mine)
    out = cli("reset", f"exercises/{NAME}", "--yes", "--course", str(course), cwd=course)
    assert out.returncode == 0, out.stderr
    assert target.read_text() == fresh
    backups = list((course / "exercises" / ".backup").glob("02_collectives.*.ipynb"))
    assert len(backups) == 1 and backups[0].read_text() == mine
    assert str(backups[0]) in out.stdout and "wrote" in out.stdout
    again = cli("reset", f"exercises/{NAME}", "--yes", "--course", str(course), cwd=course)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert len(list((course / "exercises" / ".backup").glob("*.ipynb"))) == 1


def test_reset_asks_before_overwriting(course):
    target = course / "exercises" / NAME
    target.write_text(target.read_text().replace("raise NotImplementedError", "x = 1  #", 1))
    before = target.read_text()
    out = cli("reset", str(target), "--course", str(course))       # stdin is not a terminal
    assert out.returncode == 2 and "--yes" in out.stderr
    assert target.read_text() == before
    assert not (course / "exercises" / ".backup").exists()


@pytest.mark.parametrize("path, words", [
    ("solutions/02_collectives.ipynb", "is not a file in the course's exercises folder"),
    ("notebooks/02_collectives.ipynb", "is not a file in the course's exercises folder"),
    ("exercises/../02_collectives.ipynb", "is not a file in the course's exercises folder"),
    ("exercises/99_mine.ipynb", "is not one of the course's exercise notebooks"),
    ("exercises/.backup/02_collectives.x.ipynb", "is not a file in the course's exercises"),
])
def test_reset_refuses_other_paths(course, path, words, capsys, monkeypatch):
    monkeypatch.chdir(course)
    before = {p: p.read_bytes() for p in course.rglob("*") if p.is_file()}
    code, out, err = run_main(capsys, "reset", path, "--yes", "--course", str(course))
    assert code == 2, out
    assert words in err and "allowed: exercises/02_collectives.ipynb" in err
    assert {p: p.read_bytes() for p in course.rglob("*") if p.is_file()} == before


@pytest.mark.gpu
@pytest.mark.multirank
def test_gpu_machine_checks_its_gpus_and_link():
    import torch
    out = cli("workshop", "check", "--labs", "hello", "--json")
    report = json.loads(out.stdout)
    rows = {c["name"]: c for c in report["checks"]}
    assert report["gpus"] == torch.cuda.device_count() > 0
    assert rows["gpus"]["status"] == "ok" and rows["nccl"]["status"] == "ok", rows["nccl"]
    assert rows["interconnect"]["status"] in ("ok", "info", "warn")
    if report["gpus"] >= 2:
        bw = rows["all-reduce busbw"]
        assert bw["status"] in ("ok", "warn") and bw["data"]["backend"] == "nccl"
        assert bw["data"]["busbw"] > 0
    else:
        assert rows["all-reduce busbw"]["status"] == "skip"
    assert "GPU(s), NCCL" in report["verdict"] or "NOT READY" in report["verdict"]
