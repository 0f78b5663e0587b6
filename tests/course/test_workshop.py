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
from labkit.course import course_labs, workshop

ROOT = Path(__file__).resolve().parents[2]
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
    from labkit.course.committed import committed_versions
    from labkit.runtime.launch import available_labs
    labs = set(available_labs())
    texts = {}     # each notebook as committed and as it is (a learner may have edited theirs)
    for r in workshop.COURSE_LABS:
        assert r.lab in labs, r
        nb = next(ROOT.glob(f"notebooks/{r.module}_*.ipynb"))
        if nb not in texts:
            texts[nb] = [*committed_versions(nb), nb.read_text(encoding="utf-8")]
        assert any(f"labkit.labs.{r.lab}" in t for t in texts[nb]), (r, nb)
        for need in r.needs:
            assert workshop.COURSE_LABS.index(course_labs._BY_NAME[need]) < \
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


# What current drivers print, also into a pipe: the header row underlined with terminal escapes,
# NIC rows and columns, CPU/NUMA affinity and GPU NUMA ID columns, the legends.
def _topo_m(paths: dict, n: int, nics: int = 0) -> str:
    """A `nvidia-smi topo -m` matrix of n GPUs; paths[(i, j)] (i < j) else "SYS"."""
    head = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(nics)]
    out = ["\t\x1b[4m" + "\t".join(head + ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])
           + "\x1b[0m"]
    for i in range(n):
        cells = [" X " if i == j else paths.get((min(i, j), max(i, j)), "SYS") for j in range(n)]
        cells += ["PIX" if k == i // 2 else "SYS" for k in range(nics)]
        out.append("\t".join([f"GPU{i}", *cells, "0-55,112-167" if i < n / 2 else "56-111", "0",
                              "", "N/A"]))
    for k in range(nics):
        out.append("\t".join([f"NIC{k}", *["PIX" if k == i // 2 else "SYS" for i in range(n)],
                              *[" X " if k == m else "SYS" for m in range(nics)]]))
    out += ["", "Legend:", "", "  X    = Self", "  SYS  = Connection traversing PCIe as well as "
            "the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
            "  NV#  = Connection traversing a bonded set of # NVLinks", "", "NIC Legend:", ""]
    out += [f"  NIC{k}: mlx5_{k}" for k in range(nics)]
    return "\n".join(out) + "\n"


HGX_H100 = _topo_m({(i, j): "NV18" for i in range(8) for j in range(8)}, 8, nics=4)
TWO_L4 = _topo_m({(0, 1): "PHB"}, 2)
ONE_GPU = _topo_m({}, 1)
# 8 PCIe GPUs on two sockets: pairs behind one switch (PIX), the sockets apart (SYS)
EIGHT_PCIE = _topo_m({(i, j): ("PIX" if i // 2 == j // 2 else "NODE" if i // 4 == j // 4
                               else "SYS") for i in range(8) for j in range(8)}, 8)


def test_topology_of_current_drivers_with_escapes_nics_and_legends():
    t = topology.parse_topology(HGX_H100)
    assert t["gpus"] == [f"GPU{i}" for i in range(8)]
    assert len(t["pairs"]) == 28 and set(t["pairs"].values()) == {"NV18"}
    assert t["slowest"] == "NV18"
    assert topology.parse_topology(TWO_L4)["pairs"] == {"GPU0-GPU1": "PHB"}
    one = topology.parse_topology(ONE_GPU)
    assert one["gpus"] == ["GPU0"] and one["slowest"] is None
    # what the labs can see: CUDA_VISIBLE_DEVICES=0,1 holds one PCIe switch's pair
    assert topology.parse_topology(EIGHT_PCIE)["slowest"] == "SYS"
    assert topology.parse_topology(EIGHT_PCIE, [0, 1])["slowest"] == "PIX"
    assert topology.parse_topology(EIGHT_PCIE, [0, 2])["slowest"] == "NODE"
    assert topology.visible_indices(None, 8) is None
    assert topology.visible_indices("4,5,6,7", 4) == [4, 5, 6, 7]
    assert topology.visible_indices("0,1,9", 2) == [0, 1]          # CUDA stops at a bad one
    assert topology.visible_indices("GPU-8f6d3a52-aaaa,GPU-12", 2) is None


def test_pcie_link_is_the_slowest_of_the_gpus_used():
    q = "0, 4, 16\n1, 4, 8\n2, 5, 16\n3, [N/A], [N/A]\n"
    assert topology.parse_pcie(q) == (4, 8)
    assert topology.parse_pcie(q, [2, 3]) == (5, 16)
    assert topology.parse_pcie("", None) == (None, None)
    assert topology.parse_pcie(None) == (None, None)


def _fake_machine(monkeypatch, topo: str | None, name: str, pcie: str | None = None):
    import torch
    calls = []

    def smi(*args):
        calls.append(args)
        return topo if args[:2] == ("topo", "-m") else pcie
    monkeypatch.setattr(workshop, "_smi", smi)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return calls


@pytest.mark.parametrize("topo, name, pcie, gpus, link, expected", [
    (HGX_H100, "NVIDIA H100 80GB HBM3", "", 8, "NV18", 18 * 25 * GB),   # NVLink 4: 25 GB/s/link
    (TWO_L4, "NVIDIA L4", "0, 4, 16\n1, 4, 16\n", 2, "PHB", 16e9 * 16 * (128 / 130) / 8),
])
def test_interconnect_check_reads_real_nvidia_smi_output(monkeypatch, topo, name, pcie, gpus,
                                                         link, expected):
    _fake_machine(monkeypatch, topo, name, pcie)
    c = workshop.check_interconnect(gpus)
    assert c.status == "ok", c.detail
    assert c.data["slowest"] == link and c.data["expected_busbw"] == pytest.approx(expected)
    assert "\x1b" not in c.detail and "\x1b" not in c.data["topo"]
    json.dumps(workshop._jsonable(c.data), allow_nan=False)


def test_interconnect_check_one_gpu_unreadable_matrix_and_visible_gpus(monkeypatch):
    _fake_machine(monkeypatch, ONE_GPU, "NVIDIA H100 80GB HBM3")
    assert workshop.check_interconnect(1).status == "info"          # no pair: a fact
    _fake_machine(monkeypatch, "No devices were found\n", "NVIDIA L4")
    c = workshop.check_interconnect(2)                              # 2 GPUs, no pair read
    assert c.status == "warn" and c.data["expected_busbw"] is None and "unknown" in c.detail
    _fake_machine(monkeypatch, EIGHT_PCIE, "NVIDIA L4", "\n".join(
        f"{i}, 4, 16" for i in range(8)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    c = workshop.check_interconnect(2)
    assert c.data["slowest"] == "PIX" and c.data["gpus"] == ["GPU2", "GPU3"]
    assert "CUDA_VISIBLE_DEVICES" in c.detail


def test_busbw_check_reports_a_failed_launch_as_a_row(monkeypatch):
    import labkit.runtime.launch as launch
    from labkit.course.doctor import Check
    from labkit.runtime.results import LabError

    inter = Check("interconnect", "ok", "", data={"expected_busbw": 450 * GB, "link": "NV18"})
    for exc in (ValueError("nproc=8 is more ranks than this machine holds"),
                LabError("", reason="timeout"), OSError("Too many open files")):
        def boom(target, exc=exc, **kw):
            raise exc
        monkeypatch.setattr(launch, "run_lab", boom)
        c = workshop.check_busbw(8, inter)
        assert c.status == "fail" and "--sizes 256M" in c.fix, c
    for results in ([{"backend": "nccl", "rows": []}], [], [{"backend": "nccl"}]):
        class Empty:
            launcher = "pool"
        Empty.results = results
        monkeypatch.setattr(launch, "run_lab", lambda target, **kw: Empty)
        c = workshop.check_busbw(2, inter)
        assert c.status == "fail" and "no all_reduce row" in c.detail


def _fake_labs(monkeypatch, gpus: int, report_backend: bool):
    """run_lab as the launcher runs it on a machine with `gpus` GPUs: each lab's ranks pick
    NCCL when every local rank has a GPU of its own, else gloo (labkit.runtime.system)."""
    import labkit.runtime.launch as launch
    from labkit.runtime import pool, system
    monkeypatch.delenv("LABKIT_BACKEND", raising=False)
    monkeypatch.setattr(system, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(pool, "warm", lambda *a, **k: None)
    launched = []

    def fake_run_lab(target, nproc, **kw):
        launched.append((target, nproc))

        class R:
            results = [{"backend": system.default_backend(nproc)} if report_backend else {}
                       for _ in range(nproc)]
            launcher = "pool"
        return R
    monkeypatch.setattr(launch, "run_lab", fake_run_lab)
    return launched


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_labs_on_gpus_run_nccl_where_each_rank_has_a_gpu_and_the_verdict_says_so(monkeypatch,
                                                                                 gpus):
    from labkit.course.doctor import Check
    runs = workshop.select_labs("hello,memory,semantics,threed:3d")   # 2, 1, 4 and 8 ranks
    launched = _fake_labs(monkeypatch, gpus, report_backend=False)
    rows = workshop.run_labs(runs)
    labs = {c.data["lab"]: c.data for c in rows if "lab" in c.data}
    assert launched == [(f"labkit.labs.{r.lab}", r.nproc) for r in runs]
    for r in runs:
        assert labs[r.name]["backend"] == ("nccl" if r.nproc <= gpus else "gloo"), (r, gpus)
    report = workshop.Preflight("gpu-node", [Check("gpus", "ok", ""), *rows], gpus, len(runs))
    verdict = report.verdict()
    gloo = sum(r.nproc > gpus for r in runs)
    assert "READY" in verdict and "NOT READY" not in verdict
    if gloo:
        assert f"{len(runs) - gloo} over NCCL, {gloo} over gloo on CPU (more ranks than " \
               f"the {gpus} GPU(s))" in verdict, verdict
    else:
        assert f"labs over NCCL ({len(runs)})" in verdict and "gloo" not in verdict, verdict


def test_run_labs_survives_any_launch_error_and_shows_the_ranks_it_uses(monkeypatch):
    import labkit.runtime.launch as launch
    from labkit.runtime import pool
    monkeypatch.setattr(pool, "warm", lambda *a, **k: None)

    def boom(target, **kw):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(launch, "run_lab", boom)
    shown = []
    rows = workshop.run_labs(workshop.select_labs("hello,semantics"), nproc=3,
                             progress=lambda run: shown.append((run.name, run.nproc)))
    labs = [c for c in rows if "lab" in c.data]
    assert [c.status for c in labs] == ["fail", "fail"] and "Too many open files" in labs[0].detail
    assert shown == [("hello", 3), ("semantics", 3)]        # the ranks it launches, not 2 and 4


def test_json_report_is_strict_json_on_every_path(monkeypatch, capsys, tmp_path):
    from labkit.course.doctor import Check
    odd = workshop.Preflight("h", [Check("all-reduce busbw", "warn", "", data={
        "busbw": float("nan"), "share": float("inf"), "where": tmp_path, "sizes": (1, 2)})], 2)
    got = json.loads(json.dumps(odd.to_dict(), allow_nan=False))
    assert got["checks"][0]["data"] == {"busbw": None, "share": None, "where": str(tmp_path),
                                        "sizes": [1, 2]}
    keys = set(got)
    # a check that raises is a failed row; the rest of the preflight still runs
    import labkit.runtime.launch as launch
    monkeypatch.setattr(workshop, "check_gpus", lambda: (Check("gpus", "ok", "2 GPU(s)"), 2))
    monkeypatch.setattr(workshop, "check_nccl", lambda g: Check("nccl", "ok", "2.21.5"))

    def broken(gpus):
        raise RuntimeError("CUDA error: unknown error")
    monkeypatch.setattr(workshop, "check_interconnect", broken)
    monkeypatch.setattr(launch, "run_lab", lambda *a, **k: (_ for _ in ()).throw(
        ValueError("nproc=2 is more ranks than this machine holds")))
    monkeypatch.setattr(workshop, "warm_pool", lambda: Check("lab: warm pool", "info", ""))
    report = workshop.preflight([])
    rows = {c.name: c for c in report.checks}
    assert rows["interconnect"].status == "fail" and "CUDA error" in rows["interconnect"].detail
    assert rows["all-reduce busbw"].status == "fail" and "disk" in rows
    assert set(json.loads(json.dumps(report.to_dict(), allow_nan=False))) == keys
    # and the command prints a report with the same keys when the preflight itself breaks
    monkeypatch.setattr(workshop, "preflight", lambda *a, **k: 1 / 0)
    code, out, _ = run_main(capsys, "workshop", "check", "--labs", "hello", "--json")
    got = json.loads(out)
    assert code == 1 and set(got) == keys and got["ok"] is False
    assert "NOT READY" in got["verdict"] and "ZeroDivisionError" in got["checks"][0]["detail"]


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
    """A course folder of its own, its exercise generated from the solution (the checkout's
    exercises/ hold a learner's answers: issue 28, item 13)."""
    from labkit.course.exercises import render_path
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    shutil.copy(ROOT / "solutions" / NAME, tmp_path / "solutions" / NAME)
    (tmp_path / "exercises" / NAME).write_text(render_path(tmp_path / "solutions" / NAME),
                                               encoding="utf-8")
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


@pytest.mark.parametrize("link", [".backup", ".backup/.gitignore"])
def test_reset_never_writes_through_a_link_out_of_the_course(course, tmp_path_factory, link):
    """A symlinked exercises/.backup (or its .gitignore) took the backup and a .gitignore
    outside the course: refused, the learner's file left as it was, nothing written outside."""
    outside = tmp_path_factory.mktemp("outside")
    target = course / "exercises" / NAME
    target.write_text(target.read_text().replace("raise NotImplementedError", "x = 1  #", 1))
    before = target.read_text()
    if link == ".backup":
        (course / "exercises" / ".backup").symlink_to(outside)
    else:
        (course / "exercises" / ".backup").mkdir()
        (course / "exercises" / ".backup" / ".gitignore").symlink_to(outside / "stolen")
    out = cli("reset", f"exercises/{NAME}", "--yes", "--course", str(course), cwd=course)
    assert out.returncode == 2 and "is a link" in out.stderr and "Traceback" not in out.stderr
    assert target.read_text() == before
    assert list(outside.iterdir()) == []


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
