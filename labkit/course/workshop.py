"""A workshop room's preflight and budget (issue 21): what an instructor runs before the day.

    preflight().to_dict()    # this machine's rows and verdict: `labkit workshop check --json`
    select_labs(...)         # the course's lab runs by name: "ddp" every ddp run, "ddp:compare" one
    gpu_hours(...)           # the GPU-hours (and cost) for N learners, from measured lab times
    make_handout(DIR)        # a learner's copy of the course without the answers (`handout DIR`)

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


# --- the learner handout -----------------------------------------------------------------------
# `solutions/` ships with the course: for a self-paced learner the grader is a learning aid (a
# learner's code can read the answers however the grader guards them). A workshop hands learners
# a copy without them (`labkit workshop handout DIR`) and grades the handed-in notebooks on its
# own copy (`labkit grade --reference COURSE NOTEBOOK`).

# What a handout copies from the course (an allowlist: a new top-level folder is left out, and
# said so, until it is added here); exercises/ is written afresh from solutions/, not copied.
HANDOUT_KEEP = ("labkit", "notebooks", "docs", "tools", "README.md", "Makefile",
                "pyproject.toml", "environment.yml", ".gitignore")
# Never copied, wherever they are: caches, build outputs, checkpoints, copies of edited exercises.
_HANDOUT_SKIP = {"__pycache__", ".ipynb_checkpoints", ".backup", ".pytest_cache", ".hypothesis",
                 ".git"}
REFERENCE_FILE = "labkit/course/reference.py"
# Modules that only the reference imports, with answers of their own: left out of a handout.
REFERENCE_PARTS = ("labkit/course/reference_trace.py",)
# Why each part of the course stays out of a handout.
HANDOUT_LEFT_OUT = {
    "solutions": "the answers (the exercises are generated from them)",
    "tests": "the test suite holds worked answers (tests/labs/test_*_exercise.py) and grades "
             "the solutions",
    ".git": "the history holds solutions/ (`git show HEAD:solutions/...`)",
    REFERENCE_FILE: "the checks' reference answers (min_gpus_zero3, mesh_groups, ...), "
                    "replaced by a stand-in: a check runs the learner's code, says what it "
                    "raised or returned, then that its reference answer is not here",
    **{part: "more of the checks' reference answers (module 11's), which only the reference "
             "imports" for part in REFERENCE_PARTS},
}


# labkit/course/reference.py of a handout. It holds no answer: every reference answer is an
# `_Absent` that a check may call (the check then runs the learner's code, and reports what it
# raised as usual) but not compare with: that stops the check with NotInHandout, saying what the
# learner's code returned. The reference module's helpers that take the learner's function are
# stood in for by name (REFERENCE_STUB_NAMES).
REFERENCE_STUB = '''"""A stand-in for labkit.course.reference, written by `labkit workshop handout`.

The check cells of exercises/ compare your answers with reference answers that this module
computes on the instructor's copy of the course; a learner handout leaves them out. Here a check
still runs your code and says what it raised ("not attempted yet", an exception) or what it
returned; whether that is right is said when your instructor grades the notebook you hand in.
"""
import sys

HANDOUT = True
GRADED = ("whether it is right is said when your instructor grades the notebook you hand in "
          "(labkit grade --reference COURSE exercises/NN_name.ipynb)")


class NotInHandout(BaseException):
    """A check needed a reference answer. Not an Exception, so that no check (they catch
    Exception) takes it for a wrong answer; shown as its message alone."""

    def _render_traceback_(self):
        return ["\\x1b[1;33m- no reference answer in this handout\\x1b[0m",
                *str(self).splitlines()]


def _short(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ..."


class _Absent:
    """reference.NAME here, and what calling it gives."""

    def __init__(self, what):
        self._what = what

    def __repr__(self):
        return f"<{self._what}: not in this handout>"

    __str__ = __repr__
    __hash__ = object.__hash__

    def __call__(self, *args, **kwargs):
        parts = [_short(a, 40) for a in args] + [f"{k}={_short(v, 40)}" for k, v in kwargs.items()]
        call = _Absent(f"{self._what}({', '.join(parts)})")
        if sys._getframe(1).f_code.co_name == "check_raises":   # it must raise, not return
            call._stop()
        return call

    def _stop(self, *got):
        gave = (f"your code gave {_short(got[0])}; " if got and not isinstance(got[0], _Absent)
                else "")
        raise NotInHandout(f"this check compares your answer with {self._what}, which is not in "
                           f"this learner handout: {gave}{GRADED}")

    def __eq__(self, other):
        self._stop(other)

    def __ne__(self, other):
        self._stop(other)

    def __format__(self, spec):
        return repr(self) if not spec else self._stop()


def _stopper(name):
    def stop(self, *args):
        self._stop()
    stop.__name__ = name
    return stop


for _name in ("lt le gt ge bool int float index complex iter len getitem contains neg pos abs "
              "round add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod "
              "pow rpow").split():
    setattr(_Absent, f"__{_name}__", _stopper(f"__{_name}__"))


def __getattr__(name):
    if name.startswith("_"):
        raise AttributeError(name)
    return _Absent(f"reference.{name}")


def check_with_mistakes(name, fn, cases, reference, *, rtol=1e-9, unit=None, hint=None):
    from labkit.course import grading
    grading.check_callable(name, fn, list(cases), reference, rtol=rtol, unit=unit, hint=hint)


def check_diagnosis(name, fn, cases, truth, seeds=None):
    from labkit.course import grading
    try:
        fn({})
    except NotImplementedError as exc:
        raise grading.GradingError(f"{name}: {grading.NOT_ATTEMPTED}: {name}(evidence) still "
                                   f"raises NotImplementedError({exc})", name=name) from exc
    except Exception:  # noqa: BLE001 - an empty evidence dict is not a real case
        pass
    raise NotInHandout(f"this check compares {name}(evidence) with the true {truth} of each "
                       f"case, which is not in this learner handout: {GRADED}")


def by_kind(fn):
    """`fn` returning only the kind of its reason ("memory" for "memory: needs ...")."""
    if isinstance(fn, _Absent):
        return fn

    def kind(*args, **kwargs):
        reason = fn(*args, **kwargs)
        return None if reason is None else str(reason).split(":", 1)[0].strip()
    kind.__name__ = getattr(fn, "__name__", "kind")
    return kind
'''
# What REFERENCE_STUB defines in place of the reference module's own helpers (a test checks that
# the module still has them).
REFERENCE_STUB_NAMES = ("check_with_mistakes", "check_diagnosis", "by_kind")


def _reference_stub() -> str:
    from labkit.course.grader import HANDOUT_MARK
    return f"{HANDOUT_MARK} the reference answers are not in this copy of the course.\n" + \
        REFERENCE_STUB


def _handout_readme(left_out: list[tuple[str, str]], git: bool) -> str:
    gone = "\n".join(f"- `{path}`: {why}" for path, why in left_out)
    afresh = ("`git checkout -- exercises/NN_name.ipynb`: this folder is a git\n  repository "
              "whose one commit is the handout" if git else "copy it from the handout you\n  "
              "were given: this folder has no git history")
    return f"""# A learner handout of the course

Made by `labkit workshop handout` for a workshop: the lessons, the labs and the exercises of the
course, without what holds the answers, which stay with your instructor.

- Work in `notebooks/` (lessons) and `exercises/` (your answers) as the README says.
- A check cell of an exercise runs your code and says what it raised ("not attempted yet", an
  exception) or, where it can, what it returned; then it stops with "no reference answer in
  this handout": the reference answers it compares with are not here, so it cannot say whether
  your answer is right.
- Grading happens on your instructor's copy of the course: hand in `exercises/NN_name.ipynb`;
  your instructor runs `labkit grade --reference COURSE exercises/NN_name.ipynb`. Here,
  `labkit grade` says so and grades nothing.
- Not here, because they need the solutions: `make test`, `make exercises`, `labkit reset`.
  To start an exercise afresh, {afresh}.

Left out of this copy:

{gone}
"""


@dataclass
class Handout:
    """What `make_handout` wrote: `files` (relative paths) under `target`, what it left out and
    why, the lines of the solutions that the library it copied holds too (`shared`: {file:
    count}; a learner who reads labkit's source finds them), and the git repository's state."""
    target: Path
    files: list[str]
    exercises: list[str]
    left_out: list[tuple[str, str]]
    shared: dict[str, int]
    git: str
    course_hint: str = "COURSE"

    def text(self) -> str:
        lines = [f"wrote a learner handout to {self.target}: {len(self.files)} files, "
                 f"{len(self.exercises)} exercise notebooks (written from solutions/, stubs "
                 f"only); {self.git}", "left out:"]
        lines += [f"  {path}: {why}" for path, why in self.left_out]
        if self.shared:
            top = ", ".join(f"{k} ({v})" for k, v in sorted(self.shared.items(),
                                                            key=lambda kv: -kv[1])[:5])
            lines.append(f"note: {sum(self.shared.values())} lines of the solutions are also in "
                         f"the library the exercises re-derive, which a handout keeps (the labs "
                         f"and lessons need it): {top}. The grader refuses an answer that calls "
                         "what its exercise asks for, not one that copies its source")
        lines.append(f"learners: see {self.target / 'HANDOUT.md'}; grade what they hand in "
                     f"with `labkit grade --reference {self.course_hint} NOTEBOOK`")
        return "\n".join(lines)


def _course_files(course: Path) -> list[str] | None:
    """Relative paths of the course's files as git sees its working tree (tracked, and untracked
    but not ignored), or None outside a git checkout."""
    from labkit.course.committed import _git
    if _git(course, "rev-parse", "--is-inside-work-tree") is None:
        return None
    top = _git(course, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != course.resolve():
        return None
    out = _git(course, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return None if out is None else sorted({p for p in out.split("\0") if p})


def _walk_files(course: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(course):
        dirnames[:] = [d for d in dirnames if d not in _HANDOUT_SKIP and
                       not d.endswith(".egg-info")]
        for f in filenames:
            out.append(str((Path(dirpath) / f).relative_to(course)))
    return sorted(out)


def solution_lines(solution: Path, min_chars: int = 30) -> set[str]:
    """The code lines between BEGIN/END SOLUTION markers of a solutions notebook that appear
    nowhere else in it, stripped, at least `min_chars` long (short ones, `return x`, are
    everywhere)."""
    from labkit.course import exercises as ex_mod
    inside, outside = set(), set()
    for cell in ex_mod.read_notebook(solution).cells:
        within = False
        for line in ex_mod.source_text(cell).split("\n"):
            s = line.strip()
            if s == ex_mod.BEGIN:
                within = True
            elif s == ex_mod.END:
                within = False
            elif s and not s.startswith("#"):
                (inside if within else outside).add(s)
    return {s for s in inside - outside if len(s) >= min_chars}


def _stripped_lines(path: Path) -> set[str]:
    """The stripped lines of a text file (of its cells' sources, for a notebook); none for a
    binary file."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            from labkit.course import exercises as ex_mod
            text = "\n".join(ex_mod.source_text(c) for c in ex_mod.parse_notebook(text).cells)
    except Exception:  # noqa: BLE001 - binary, or a notebook nbformat cannot read
        return set()
    return {line.strip() for line in text.split("\n")}


def _git_commit(target: Path) -> str:
    """Make `target` a fresh git repository whose one commit is the handout; what happened."""
    import subprocess
    git = shutil.which("git")
    if git is None:
        return "no git repository (git is not installed)"
    quiet = ["-c", "init.defaultBranch=main", "-c", "user.name=labkit workshop handout",
             "-c", "user.email=handout@labkit.invalid", "-c", "commit.gpgsign=false",
             "-c", f"core.hooksPath={os.devnull}", "-c", "core.autocrlf=false"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        for args in (["init", "-q"], ["add", "-A", "-f"],     # -f: all it wrote, nothing else
                     ["commit", "-q", "--no-verify", "-m", "A learner handout of the course "
                      "(labkit workshop handout)"]):
            subprocess.run([git, *quiet, *args], cwd=target, env=env, check=True,
                           capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(target / ".git", ignore_errors=True)
        err = getattr(exc, "stderr", b"") or b""
        return (f"no git repository (git failed: {err.decode(errors='replace').strip() or exc})")
    return "a fresh git repository whose one commit is this handout"


def make_handout(target: Path | str, course: Path | str | None = None, *,
                 git: bool = True) -> Handout:
    """Write a learner's copy of `course` (default: the course this labkit belongs to) to
    `target`, a new or empty folder outside the course, holding nothing that holds an answer:

    - copied: HANDOUT_KEEP's entries (labkit/, notebooks/, docs/, tools/, README.md, ...), as
      the working tree has them (in a git checkout, the files git tracks or would: not what it
      ignores), never a link (it could point at the answers) nor caches and `.backup/` copies;
    - exercises/NN_*.ipynb written afresh from solutions/ (the generator's bytes: stubs only,
      never an edited copy of the instructor's);
    - labkit/course/reference.py replaced by a stand-in (REFERENCE_STUB): a check still runs the
      learner's code and says what it raised, then, instead of comparing, "no reference answer
      in this handout" with what the code returned; HANDOUT.md added (what is not here, how it
      is graded);
    - left out, and said so: solutions/, tests/, .git (`HANDOUT_LEFT_OUT`), every other
      top-level entry; with `git`, the folder becomes a fresh repository whose one commit is the
      handout (the learner's `git checkout -- exercises/...` resets an exercise), else it has
      no .git at all.

    ValueError (the message says why) for a `target` that exists and is not an empty folder, or
    lies inside the course, or a course without solutions/."""
    from labkit.course import exercises as ex_mod
    course = Path(course or REPO_ROOT).resolve()
    target = Path(target).expanduser()
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise ValueError(f"{target} exists and is not a folder; name a new or empty folder")
        entries = sorted(p.name for p in target.iterdir())
        if entries:
            shown = ", ".join(entries[:3]) + (" ..." if len(entries) > 3 else "")
            raise ValueError(f"{target} exists and is not empty ({len(entries)} entries: "
                             f"{shown}); name a new or empty folder: nothing there is "
                             "overwritten")
    resolved = target.resolve()
    if resolved == course or course in resolved.parents:
        raise ValueError(f"{target} is inside the course ({course}): a handout sits beside "
                         "solutions/ there; name a folder outside it (e.g. ../handout)")
    solutions = course / "solutions"
    sols = ex_mod.solution_files(solutions) if solutions.is_dir() else []
    if not sols:
        raise ValueError(f"{course} has no solutions/*.ipynb: a handout is made from the "
                         "instructor's copy of the course (its exercises are written from them)")
    # every exercise is rendered and checked before anything is written
    rendered = {s.name: ex_mod.render_path(s) for s in sols}
    for s in sols:
        leaks = ex_mod.leaked_lines(ex_mod.read_notebook(s),
                                    ex_mod.parse_notebook(rendered[s.name]))
        if leaks:       # the generator refuses such a notebook; never hand one out
            raise ValueError(f"exercises/{s.name} would hold lines of its solution "
                             f"({leaks[:2]}); run `python -m labkit.course.exercises --check`")

    listed = _course_files(course)
    in_git = listed is not None
    listed = listed if in_git else _walk_files(course)
    copy, links, skipped = [], [], set()
    for rel in listed:
        parts = Path(rel).parts
        if parts[0] not in HANDOUT_KEEP:
            skipped.add(parts[0])
            continue
        if rel == REFERENCE_FILE or rel in REFERENCE_PARTS or set(parts) & _HANDOUT_SKIP or \
                any(p.endswith(".egg-info") for p in parts):
            continue
        src = course / rel
        if any((course / Path(*parts[:i])).is_symlink() for i in range(1, len(parts) + 1)):
            links.append(rel)
            continue
        if src.is_file():
            copy.append(rel)
    if not in_git:
        skipped |= {p.name for p in course.iterdir()} - set(HANDOUT_KEEP)
    skipped -= {"exercises"}

    left_out = [(f"{name}/" if (course / name).is_dir() else name, why)
                for name, why in HANDOUT_LEFT_OUT.items() if (course / name).exists()]
    known = {name.split("/")[0] for name in HANDOUT_LEFT_OUT}
    others = sorted(skipped - known)
    if others:
        left_out.append((", ".join(f"{n}/" if (course / n).is_dir() else n for n in others),
                         "not part of what a learner works with (CI, build outputs, caches)"))
    if links:
        left_out.append((", ".join(links[:5]) + (" ..." if len(links) > 5 else ""),
                         "links: one could point at the answers"))
    left_out.append(("exercises/ as it is in the course",
                     "written afresh from solutions/ instead: no edited copy of yours is "
                     "handed out"))
    if in_git:
        left_out.append(("what git ignores (.venv/, *.egg-info/, caches, .backup/ ...)",
                         "not part of the course"))

    learner_left_out = [item for item in left_out if item[0].rstrip("/") in HANDOUT_LEFT_OUT]
    existed = target.exists()
    try:
        written = _write_handout(course, target, copy, rendered, learner_left_out, git)
    except BaseException:       # nothing half-written is left behind (the folder was empty)
        if existed:
            for p in target.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            shutil.rmtree(target, ignore_errors=True)
        raise
    git_state = written.pop()
    secret = set().union(*(solution_lines(s) for s in sols))
    shared = {rel: n for rel in copy if (n := len(secret & _stripped_lines(target / rel)))}
    return Handout(target, sorted(written), sorted(rendered), left_out, shared, git_state,
                   course_hint=str(course))


def _write_handout(course: Path, target: Path, copy: list[str], rendered: dict[str, str],
                   left_out: list[tuple[str, str]], git: bool) -> list[str]:
    """Write the handout's files (`make_handout`): the relative paths written, then what
    happened with git."""
    from labkit.course.grader import HANDOUT_FILE
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for rel in copy:
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(course / rel, dest)
        shutil.copymode(course / rel, dest)
        written.append(rel)
    (target / "exercises").mkdir(exist_ok=True)
    for name, text in rendered.items():
        (target / "exercises" / name).write_text(text, encoding="utf-8")
        written.append(f"exercises/{name}")
    if (course / REFERENCE_FILE).is_file():
        stub = target / REFERENCE_FILE
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text(_reference_stub(), encoding="utf-8")
        written.append(REFERENCE_FILE)
    readme = target / HANDOUT_FILE
    readme.write_text(_handout_readme(left_out, bool(git and shutil.which("git"))),
                      encoding="utf-8")
    written.append(HANDOUT_FILE)
    git_state = _git_commit(target) if git else "no git repository (--no-git)"
    if git and not git_state.startswith("a fresh"):   # the note must not promise one
        readme.write_text(_handout_readme(left_out, False), encoding="utf-8")
    return written + [git_state]
