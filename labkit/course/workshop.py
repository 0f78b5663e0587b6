"""A workshop room's preflight and budget (issue 21): what an instructor runs before the day.

    preflight().to_dict()    # this machine's rows and verdict: `labkit workshop check --json`
    select_labs(...)         # the course's lab runs by name: "ddp" every ddp run, "ddp:compare" one
    gpu_hours(...)           # the GPU-hours (and cost) for N learners, from measured lab times

Without CUDA every GPU row is skipped with its reason and the labs run over gloo, as on a
learner's laptop; what each row checks: `preflight` and docs/runtime.md.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
import math
import os
from pathlib import Path
import platform
import shutil
import tempfile
import time

from labkit.course import doctor
from labkit.course.course_labs import COURSE_LABS, LabRun, select_labs  # noqa: F401
from labkit.course.budget import Budget, format_budget, gpu_hours  # noqa: F401 (API)
from labkit.course.doctor import Check
from labkit.hardware import GB
from labkit.topology import (BUSBW_OK_SHARE, BUSBW_SIZE, busbw_verdict, expected_busbw,
                             parse_pcie, parse_topology, strip_ansi, visible_indices)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Free disk: labs write checkpoints of small models (MBs); Jupyter and pip want room too.
DISK_FAIL = 1 * GB
DISK_WARN = 5 * GB


# --- the checks --------------------------------------------------------------------------------

def _skip(name: str, why: str) -> Check:
    return Check(name, "skip", why, data={"skipped": why})


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _guarded(name: str, check, *args, **kwargs):
    """check(*args) or, if it raises, a failed row saying so (one broken check must not end the
    preflight, nor a --json report)."""
    try:
        return check(*args, **kwargs)
    except Exception as exc:
        return Check(name, "fail", f"the check itself failed: {type(exc).__name__}: "
                     f"{_first_line(exc)}", "report this with `labkit doctor`'s output",
                     data={"error": type(exc).__name__})


def check_gpus() -> tuple[Check, int]:
    """The doctor's GPU row and the count; with none, a skip row saying why."""
    c = doctor.check_gpus()
    n = (c.data or {}).get("count", 0)
    if n == 0:
        why = ("no CUDA (" + c.detail.removeprefix("none (") if c.detail.startswith("none (")
               else f"no CUDA: {c.detail}")
        return _skip("gpus", why), 0
    return c, n


def check_nccl(gpus: int) -> Check:
    if gpus == 0:
        return _skip("nccl", "no CUDA: NCCL needs GPUs; labs use gloo")
    found = [c for c in doctor.check_backends() if c.name == "nccl"]
    c = found[0] if found else Check("nccl", "fail", "torch.distributed is not available")
    if c.status != "ok":
        return Check("nccl", "fail", c.detail, "install a CUDA build of torch with NCCL "
                     "(pip install torch==2.13.0 from the CUDA wheel index)")
    return c


def _smi(*args: str) -> str | None:
    """`nvidia-smi ARGS`'s output, or None (the doctor's runner; tests replace this)."""
    return doctor.nvidia_smi(*args)[0]


def check_interconnect(gpus: int) -> Check:
    if gpus == 0:
        return _skip("interconnect", "no CUDA: no GPU-to-GPU link to read (nvidia-smi topo -m)")
    text = _smi("topo", "-m")
    if text is None:
        return Check("interconnect", "warn", "nvidia-smi topo -m failed or nvidia-smi is missing",
                     "install the NVIDIA driver's tools (nvidia-smi) to see the topology")
    text = strip_ansi(text)
    # nvidia-smi lists every GPU of the machine; the labs use those CUDA_VISIBLE_DEVICES shows
    visible = visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
    topo = parse_topology(text, visible)
    import torch
    name = torch.cuda.get_device_name(0)
    gen, width = parse_pcie(_smi("--query-gpu=index,pcie.link.gen.max,pcie.link.width.max",
                                 "--format=csv,noheader,nounits"), visible)
    bw, link = expected_busbw(topo["slowest"], name, gen, width)
    status = "ok" if topo["slowest"] else "info"
    seen = f" (nvidia-smi's {', '.join(topo['gpus'])}: CUDA_VISIBLE_DEVICES)" if visible else ""
    if gpus >= 2 and topo["slowest"] is None:
        status, link = "warn", (f"unknown: {gpus} GPUs, but no GPU-to-GPU path could be read "
                                "from nvidia-smi topo -m")
    elif gpus >= 2 and visible is None and len(topo["gpus"]) != gpus:
        seen = f" (the matrix lists {len(topo['gpus'])} GPUs, torch sees {gpus})"
    return Check("interconnect", status,
                 f"{name} x {gpus}; slowest GPU-to-GPU path {link}{seen}\nnvidia-smi topo -m\n"
                 + text.rstrip(),
                 "" if status != "warn" else "run `nvidia-smi topo -m` and check its GPU rows",
                 data={**topo, "gpu": name, "expected_busbw": bw, "link": link,
                       "pcie_gen": gen, "pcie_width": width, "visible": visible, "topo": text})


def check_busbw(gpus: int, interconnect: Check, timeout: float = 300.0) -> Check:
    """all_reduce of BUSBW_SIZE on every local GPU (labkit.labs.collectives over NCCL), its
    busbw beside the link's per-direction bandwidth."""
    if gpus == 0:
        return _skip("all-reduce busbw", "no CUDA: the GPU all-reduce is not measured")
    if gpus == 1:
        return _skip("all-reduce busbw", "one GPU: no link between GPUs to measure")
    from labkit.runtime.launch import run_lab
    see = (f"run `labkit run collectives -n {gpus} -- --ops all_reduce --sizes {BUSBW_SIZE}` "
           "to see every rank's output")
    try:
        r = run_lab("labkit.labs.collectives", nproc=gpus, timeout=timeout, quiet=True,
                    args=["--ops", "all_reduce", "--sizes", BUSBW_SIZE, "-n", "20", "-w", "5",
                          "--plot", ""], env={"LABKIT_BACKEND": "nccl"})
    except Exception as exc:     # LabError; ValueError (more ranks than run_lab allows); OSError
        return Check("all-reduce busbw", "fail", f"the NCCL all-reduce failed: {_first_line(exc)}",
                     see, data={"error": type(exc).__name__})
    rows = [x for x in ((r.results[0] if r.results else {}) or {}).get("rows") or []
            if isinstance(x, dict) and x.get("op") == "all_reduce"
            and isinstance(x.get("busbw"), (int, float)) and math.isfinite(x["busbw"])]
    if not rows:
        return Check("all-reduce busbw", "fail", "the collectives lab ran but reported no "
                     "all_reduce row", see, data={"error": "no rows"})
    row = max(rows, key=lambda x: x["busbw"])
    expected = interconnect.data.get("expected_busbw")
    status, share = busbw_verdict(row["busbw"], expected)
    detail = (f"{gpus} GPUs, {row['size'] / 2**20:.0f} MiB: busbw {row['busbw'] / GB:.1f} GB/s "
              f"(algbw {row['algbw'] / GB:.1f} GB/s)")
    detail += (f", {share:.0%} of the link's {expected / GB:.1f} GB/s" if share is not None
               else f"; no link figure to compare with ({interconnect.data.get('link', '?')})")
    fix = "" if status != "warn" else (
        f"below {BUSBW_OK_SHARE:.0%} of the link: check peer-to-peer (nvidia-smi topo -p2p r), "
        "NCCL_P2P_DISABLE/NCCL_IB_DISABLE in the environment, and that no other job uses the GPUs")
    return Check("all-reduce busbw", status, detail, fix,
                 data={"busbw": row["busbw"], "algbw": row["algbw"], "size": row["size"],
                       "expected": expected, "share": share, "backend": r.results[0]["backend"]})


def check_disk(paths=None) -> Check:
    where = {"course": str(REPO_ROOT), "temp": tempfile.gettempdir()} if paths is None else paths
    free = {k: shutil.disk_usage(p).free for k, p in where.items()}
    least = min(free, key=free.get)
    status = "fail" if free[least] < DISK_FAIL else "warn" if free[least] < DISK_WARN else "ok"
    detail = ", ".join(f"{k} ({where[k]}): {v / GB:.1f} GB free ({v / 2**30:.1f} GiB)"
                       for k, v in free.items())
    fix = "" if status == "ok" else (f"free space on {where[least]}: labs and Jupyter want "
                                     f">= {DISK_WARN / GB:.0f} GB")
    return Check("disk", status, detail, fix, data={"free_bytes": free})


def warm_pool() -> Check:
    """Start the warm pool (torch and transformers imported once), timed as its own row."""
    from labkit.runtime import pool
    t0 = time.monotonic()
    try:
        warmed = pool.warm(preload=["transformers"], wait=True)
    except Exception as exc:       # the labs still run under torchrun
        return Check("lab: warm pool", "warn", f"the warm pool did not start: {exc}",
                     "labs fall back to torchrun (slower starts)")
    seconds = time.monotonic() - t0
    return Check("lab: warm pool", "ok" if warmed else "info",
                 f"imports torch and transformers once, {seconds:.1f} s"
                 if warmed else "no warm pool here (not Linux): labs use torchrun",
                 data={"seconds": seconds})


def run_labs(runs: list[LabRun], timeout: float = 600.0, nproc: int | None = None,
             progress=None, warm: bool = True) -> list[Check]:
    """Launch each run once (warm pool first, timed as its own row, unless warm=False) and time
    it. nproc: run every lab on this many ranks instead of the notebook's (a lab needing a
    fixed count, the 3D one, keeps its own). A lab wanting more ranks than there are GPUs runs
    over gloo on CPU (labkit.runtime.system.default_backend), as it does in the notebooks."""
    from labkit.runtime import system
    from labkit.runtime.launch import LabError, run_lab

    rows = [warm_pool()] if warm else []
    failed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="labkit-workshop-") as tmp:
        for run in runs:
            n = run.nproc if (nproc is None or run.lab == "threed") else nproc
            if progress:
                progress(replace(run, nproc=n))
            name = f"lab {run.module} {run.name}"
            data = {"lab": run.name, "module": run.module, "nproc": n}
            if failed & set(run.needs):
                rows.append(_skip(name, f"needs {', '.join(run.needs)}, which failed"))
                rows[-1].data.update(data)
                continue
            args = [a.replace("{tmp}", tmp) for a in run.args]
            t = time.monotonic()
            try:
                r = run_lab(f"labkit.labs.{run.lab}", nproc=n, args=args, timeout=timeout,
                            quiet=True)
                seconds, error = time.monotonic() - t, None
            except LabError as exc:
                seconds, error, r = time.monotonic() - t, exc, exc.result
            except Exception as exc:        # ValueError: more ranks than this machine holds, ...
                seconds, error, r = time.monotonic() - t, exc, None
            # what the lab reported, else what its ranks' dist.setup picks for n local ranks
            reported = r.results[0] if r is not None and r.results else None
            backend = (reported.get("backend") if isinstance(reported, dict) else None) \
                or _guess_backend(system, n)
            data.update(seconds=seconds, backend=backend,
                        launcher=getattr(r, "launcher", None))
            if (error is None) == (not run.fails):
                how = "failed as the lesson means it to" if run.fails else "ok"
                on = f"{n} rank{'s' if n != 1 else ''}, {backend}"
                rows.append(Check(name, "ok", f"{on}: {seconds:.1f} s ({how})", data=data))
            else:
                failed.add(run.name)
                first = _first_line(error) if error else \
                    "it should have failed (its crash did not happen)"
                rows.append(Check(name, "fail", f"{n} ranks: {first}",
                                  f"run `labkit run {run.lab} -n {n} -- {' '.join(run.args)}` "
                                  "to see every rank's output", data=data))
    return rows


def _guess_backend(system, n: int) -> str | None:
    try:
        return system.default_backend(n)
    except ValueError:              # LABKIT_BACKEND set to something else: the lab said why
        return None


# --- the report --------------------------------------------------------------------------------

@dataclass
class Preflight:
    host: str
    checks: list[Check]
    gpus: int = 0
    labs_run: int = 0
    seconds: float = 0.0
    machine: dict = field(default_factory=dict)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def lab_times(self) -> dict[str, float]:
        """{run name: wall seconds} of the labs that ran as they should."""
        return {c.data["lab"]: c.data["seconds"] for c in self.checks
                if c.status == "ok" and "lab" in c.data}

    def verdict(self) -> str:
        """One line per machine: READY / READY with warnings / NOT READY, and why."""
        labs = self.lab_times()
        took = f"{len(labs)}/{self.labs_run} labs ran in {sum(labs.values()):.0f} s"
        if self.failures:
            names = ", ".join(c.name for c in self.failures[:4])
            more = f" (+{len(self.failures) - 4})" if len(self.failures) > 4 else ""
            return f"{self.host}: NOT READY: {len(self.failures)} failed: {names}{more}; {took}"
        if self.gpus == 0:
            where = "CPU-only: labs run over gloo; GPU checks skipped (no CUDA)"
        else:
            bw = next((c for c in self.checks if c.name == "all-reduce busbw"), None)
            share = bw.data.get("share") if bw is not None else None
            where = f"{self.gpus} GPU(s), NCCL" + (f", all-reduce at {share:.0%} of the link"
                                                   if share is not None else "")
            where += self._lab_backends()
        warn = (f"; {len(self.warnings)} warning(s): "
                f"{', '.join(c.name for c in self.warnings)}") if self.warnings else ""
        return f"{self.host}: READY{' with warnings' if warn else ''}: {where}; {took}{warn}"

    def _lab_backends(self) -> str:
        """On a GPU machine: which backend the labs ran on. A lab wanting more ranks than there
        are GPUs runs over gloo on CPU (NCCL needs a GPU per rank), so the NCCL rows above say
        nothing about it."""
        ran = [c.data for c in self.checks if c.status == "ok" and "lab" in c.data]
        gloo = [d for d in ran if d.get("backend") == "gloo"]
        if not gloo:
            return f"; labs over NCCL ({len(ran)})" if ran else ""
        why = (f" (more ranks than the {self.gpus} GPU(s))"
               if all(d.get("nproc", 0) > self.gpus for d in gloo) else "")
        return (f"; labs: {len(ran) - len(gloo)} over NCCL, {len(gloo)} over gloo on "
                f"CPU{why}")

    def to_dict(self) -> dict:
        """The report as JSON-ready values (non-finite numbers as null, anything else as text),
        with the same keys on every path."""
        return _jsonable({"host": self.host, "ok": self.ok, "verdict": self.verdict(),
                          "gpus": self.gpus, "machine": self.machine, "seconds": self.seconds,
                          "lab_seconds": self.lab_times(),
                          "checks": [asdict(c) for c in self.checks]})

    def text(self) -> str:
        mark = {"ok": "ok  ", "info": "--  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
        width = max(len(c.name) for c in self.checks)
        lines = [f"labkit workshop check: {self.host}", ""]
        for c in self.checks:
            detail = c.detail.replace("\n", "\n" + " " * (width + 11))
            lines.append(f"  [{mark[c.status]}] {c.name:<{width}}  {detail}")
            if c.status in ("warn", "fail") and c.fix:
                lines.append(" " * (width + 13) + f"what to do: {c.fix}")
        return "\n".join(lines + ["", self.verdict()])


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def preflight(runs: list[LabRun] | None = None, nproc: int | None = None,
              timeout: float = 600.0, progress=None) -> Preflight:
    """Every check of this machine, then each run of `runs` (default: one per lab program).

    The rows (the doctor's `Check`: ok / info / warn / fail, plus "skip" with its reason): the
    machine, its GPUs, NCCL, the interconnect (`nvidia-smi topo -m`, parsed), a timed
    all-reduce's bus bandwidth on all local GPUs beside what the link should give, free disk,
    and each course lab launched once with its wall time; then a one-line verdict. On a machine
    without CUDA every GPU row is skipped and the labs run over gloo, as a learner's laptop runs
    them: the verdict says so. On a GPU machine a lab wanting more ranks than there are GPUs
    runs over gloo on CPU too (NCCL needs a GPU per rank; as in the notebooks), and the verdict
    counts the labs on each backend."""
    t0 = time.monotonic()
    runs = select_labs() if runs is None else runs
    gpus = 0
    gpu_row = _guarded("gpus", check_gpus)      # torch missing or broken: a failed row
    if isinstance(gpu_row, tuple):
        gpu_row, gpus = gpu_row
    inter = _guarded("interconnect", check_interconnect, gpus)
    # the warm pool starts before the first lab (the busbw run): its row times the imports
    warm = warm_pool()
    checks = [_guarded("python", doctor.check_python), _guarded("torch", doctor.check_torch),
              _guarded("cpu cores", doctor.check_cpu_ram), gpu_row,
              _guarded("nccl", check_nccl, gpus), inter,
              _guarded("all-reduce busbw", check_busbw, gpus, inter, timeout),
              _guarded("disk", check_disk), _guarded("free port", doctor.check_port), warm]
    checks = [c for row in checks for c in (row if isinstance(row, list) else [row])]
    checks += run_labs(runs, timeout=timeout, nproc=nproc, progress=progress, warm=False)
    return Preflight(platform.node() or "this machine", checks, gpus, len(runs),
                     time.monotonic() - t0, host_env())


def failed_preflight(exc: BaseException, seconds: float = 0.0) -> Preflight:
    """The report of a preflight that could not finish (its --json keeps the same keys)."""
    return Preflight(platform.node() or "this machine",
                     [Check("preflight", "fail", f"the preflight itself failed: "
                            f"{type(exc).__name__}: {_first_line(exc)}",
                            "report this with `labkit doctor`'s output",
                            data={"error": type(exc).__name__})],
                     seconds=seconds, machine=host_env())


def host_env() -> dict:
    """The machine's cores and load when it measured (another job on the cores slows labs)."""
    return {"cores": os.cpu_count(), "load_1min": os.getloadavg()[0]
            if hasattr(os, "getloadavg") else None}
