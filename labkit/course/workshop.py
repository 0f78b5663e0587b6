"""A workshop room's preflight and budget (issue 21): what an instructor runs before the day.

- `preflight(...)` runs on each machine of the room and returns a `Preflight`: rows (the
  doctor's `Check`: ok / info / warn / fail, plus "skip" with its reason) for the machine, its
  GPUs, NCCL, the interconnect (`nvidia-smi topo -m`, parsed), a timed all-reduce's bus
  bandwidth on all local GPUs beside what the link should give, free disk, and each course lab
  launched once with its wall time; then a one-line verdict. `to_dict()` is what
  `labkit workshop check --json` prints, for collecting a room's results.
- `COURSE_LABS`: every lab run the course's notebooks make (module, lab, ranks, arguments), in
  course order; `select_labs` picks them by name ("ddp" is every ddp run, "ddp:compare" one).
- `gpu_hours(...)`: the GPU-hours (and cost) a workshop of N learners needs, from measured
  lab times.

On a machine without CUDA every GPU row is skipped with its reason and the labs run over gloo,
as a learner's laptop runs them: the verdict says so.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
import os
from pathlib import Path
import platform
import shutil
import subprocess
import tempfile
import time

from labkit import validate
from labkit.course import doctor
from labkit.course.doctor import Check
from labkit.hardware import GB
from labkit.topology import (BUSBW_OK_SHARE, BUSBW_SIZE, busbw_verdict, expected_busbw,
                             parse_topology)

REPO_ROOT = Path(__file__).resolve().parents[2]

# --- the course's lab runs ---------------------------------------------------------------------


@dataclass(frozen=True)
class LabRun:
    """One run_lab call of a course notebook. `{tmp}` in args is a folder of this preflight's
    own (checkpoints); `needs`: runs that must come first (they write what this one reads);
    `fails`: the run is meant to fail (the crash of module 05's resume lesson)."""
    name: str
    module: str            # "05" (notebooks/05_*.ipynb)
    lab: str               # a module of labkit.labs
    nproc: int
    args: tuple[str, ...] = ()
    preflight: bool = False     # one run per lab program: what `workshop check` runs by default
    quick: bool = False         # what `workshop check --quick` runs
    needs: tuple[str, ...] = ()
    fails: bool = False


_CKPT = ("--steps", "8", "--save-every", "2")
_COLL = ("--sizes", "4K,64K,512K,2M,8M", "-n", "3", "-w", "1", "--plot", "")

# Every run_lab of notebooks/, with the notebook's own arguments (module 09 launches none; the
# %%torchrun cells of 00, 02 and 03 run a few lines inline and are left out).
COURSE_LABS: tuple[LabRun, ...] = (
    LabRun("hello", "00", "hello", 2, (), preflight=True, quick=True),
    LabRun("memory", "01", "memory", 1, (), preflight=True, quick=True),
    LabRun("memory:llama", "01", "memory", 1, ("--model", "debug-llama")),
    LabRun("memory:fp32", "01", "memory", 2, ("--precision", "fp32")),
    LabRun("semantics", "02", "semantics", 4, (), preflight=True, quick=True),
    LabRun("collectives", "02", "collectives", 4, _COLL, preflight=True),
    LabRun("ddp:sampler", "03", "ddp", 4, ("--part", "sampler", "--samples", "10")),
    LabRun("ddp:compare", "03", "ddp", 2, ("--part", "compare"), preflight=True),
    LabRun("ddp:flags", "03", "ddp", 2, ("--part", "flags", "--steps", "2")),
    LabRun("ddp:straggler", "03", "ddp", 2, ("--part", "straggler", "--sleep", "0.05")),
    LabRun("zero", "04", "zero", 4, (), preflight=True),
    LabRun("fsdp:compare", "05", "fsdp", 4, ("--part", "compare"), preflight=True),
    LabRun("fsdp:timeline", "05", "fsdp", 4, ("--part", "timeline")),
    LabRun("fsdp:options", "05", "fsdp", 4, ("--part", "options")),
    LabRun("fsdp:options-gpt2", "05", "fsdp", 4, ("--part", "options", "--model", "gpt2")),
    LabRun("fsdp:fsdp1", "05", "fsdp", 2, ("--part", "fsdp1")),
    LabRun("dcp:save", "05", "dcp", 4, ("--part", "save"), preflight=True),
    LabRun("dcp:async", "05", "dcp", 4, ("--part", "async")),
    LabRun("dcp:export", "05", "dcp", 4, ("--part", "export")),
    LabRun("dcp:reshard", "05", "dcp", 4, ("--part", "reshard", "--ckpt-dir", "{tmp}/reshard")),
    LabRun("dcp:reshard-2", "05", "dcp", 2, ("--part", "reshard", "--ckpt-dir", "{tmp}/reshard"),
           needs=("dcp:reshard",)),
    LabRun("checkpoint", "05", "checkpoint", 4, (*_CKPT, "--ckpt-dir", "{tmp}/clean"),
           preflight=True),
    LabRun("checkpoint:crash", "05", "checkpoint", 4,
           (*_CKPT, "--ckpt-dir", "{tmp}/run", "--crash-at-step", "5"), fails=True),
    LabRun("checkpoint:resume", "05", "checkpoint", 4,
           (*_CKPT, "--ckpt-dir", "{tmp}/run", "--resume"), needs=("checkpoint:crash",)),
    LabRun("tp:block-2", "06", "tp", 2, ("--part", "block"), preflight=True),
    LabRun("tp:block-4", "06", "tp", 4, ("--part", "block")),
    LabRun("tp:dtensor", "06", "tp", 2, ("--part", "dtensor")),
    LabRun("tp:sp", "06", "tp", 2, ("--part", "sp")),
    LabRun("tp:pitfall", "06", "tp", 2, ("--part", "pitfall")),
    LabRun("pp:byhand", "07", "pp", 4, ("--part", "byhand"), preflight=True),
    LabRun("pp:torch", "07", "pp", 4, ("--part", "torch")),
    LabRun("pp:ppdp", "07", "pp", 4, ("--part", "ppdp")),
    LabRun("threed:mesh", "08", "threed", 4, ("--part", "mesh"), preflight=True),
    LabRun("threed:2d", "08", "threed", 4, ("--part", "2d")),
    LabRun("threed:ppdp", "08", "threed", 4, ("--part", "ppdp")),
    LabRun("threed:3d", "08", "threed", 8, ("--part", "3d")),
    LabRun("threed:cp", "08", "threed", 2, ("--part", "cp")),
)
_BY_NAME = {r.name: r for r in COURSE_LABS}


def select_labs(spec: str | None = None, quick: bool = False) -> list[LabRun]:
    """The runs `spec` names, in course order, with what they need first. spec: None (one run
    per lab program, or the --quick subset), "all", or comma-separated names: a run
    ("ddp:compare"), a lab ("ddp": its every run) or a module ("05")."""
    if spec is None or not spec.strip():
        chosen = [r for r in COURSE_LABS if (r.quick if quick else r.preflight)]
    elif spec.strip() == "all":
        chosen = list(COURSE_LABS)
    else:
        names = set()
        for word in (w.strip() for w in spec.split(",")):
            hits = [r.name for r in COURSE_LABS if word in (r.name, r.lab, r.module)]
            if not word or not hits:
                labs = sorted({r.lab for r in COURSE_LABS})
                raise ValueError(
                    f"labs={spec!r}: {word!r} is not a course lab; allowed: 'all', a lab "
                    f"({', '.join(labs)}), a module (00 to 08) or a run "
                    f"({', '.join(r.name for r in COURSE_LABS if ':' in r.name)})")
            names.update(hits)
        chosen = [r for r in COURSE_LABS if r.name in names]
    wanted = {r.name for r in chosen}
    todo = list(wanted)
    while todo:                       # add what the chosen runs read
        for need in _BY_NAME[todo.pop()].needs:
            if need not in wanted:
                wanted.add(need)
                todo.append(need)
    return [r for r in COURSE_LABS if r.name in wanted]


# Free disk: labs write checkpoints of small models (MBs); Jupyter and pip want room too.
DISK_FAIL = 1 * GB
DISK_WARN = 5 * GB


# --- the checks --------------------------------------------------------------------------------

def _skip(name: str, why: str) -> Check:
    return Check(name, "skip", why, data={"skipped": why})


def check_gpus() -> tuple[Check, int]:
    import torch
    n = 0
    if torch.version.cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
    if n == 0:
        why = "CPU build of torch" if not torch.version.cuda else "no CUDA device visible"
        return _skip("gpus", f"no CUDA ({why}): labs run on CPU over gloo"), 0
    return doctor.check_gpus(), n


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
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def check_interconnect(gpus: int) -> Check:
    if gpus == 0:
        return _skip("interconnect", "no CUDA: no GPU-to-GPU link to read (nvidia-smi topo -m)")
    text = _smi("topo", "-m")
    if text is None:
        return Check("interconnect", "warn", "nvidia-smi topo -m failed or nvidia-smi is missing",
                     "install the NVIDIA driver's tools (nvidia-smi) to see the topology")
    topo = parse_topology(text)
    import torch
    name = torch.cuda.get_device_name(0)
    gen = width = None
    q = _smi("--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader,nounits")
    if q:
        try:
            gen, width = (int(x) for x in q.splitlines()[0].split(","))
        except ValueError:
            pass
    bw, link = expected_busbw(topo["slowest"], name, gen, width)
    return Check("interconnect", "ok" if topo["slowest"] else "info",
                 f"{name} x {gpus}; slowest GPU-to-GPU path {link}\nnvidia-smi topo -m\n"
                 + text.rstrip(),
                 data={**topo, "gpu": name, "expected_busbw": bw, "link": link,
                       "pcie_gen": gen, "pcie_width": width, "topo": text})


def check_busbw(gpus: int, interconnect: Check, timeout: float = 300.0) -> Check:
    """all_reduce of BUSBW_SIZE on every local GPU (labkit.labs.collectives over NCCL), its
    busbw beside the link's per-direction bandwidth."""
    if gpus == 0:
        return _skip("all-reduce busbw", "no CUDA: the GPU all-reduce is not measured")
    if gpus == 1:
        return _skip("all-reduce busbw", "one GPU: no link between GPUs to measure")
    from labkit.runtime.launch import LabError, run_lab
    try:
        r = run_lab("labkit.labs.collectives", nproc=gpus, timeout=timeout, quiet=True,
                    args=["--ops", "all_reduce", "--sizes", BUSBW_SIZE, "-n", "20", "-w", "5",
                          "--plot", ""], env={"LABKIT_BACKEND": "nccl"})
    except LabError as exc:
        return Check("all-reduce busbw", "fail", f"the NCCL all-reduce failed: "
                     f"{str(exc).strip().splitlines()[0]}",
                     f"run `labkit run collectives -n {gpus} -- --ops all_reduce` to see why")
    row = max(r.results[0]["rows"], key=lambda x: x["busbw"])
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


def run_labs(runs: list[LabRun], timeout: float = 600.0, nproc: int | None = None,
             progress=None) -> list[Check]:
    """Launch each run once (warm pool first, timed as its own row) and time it. nproc: run
    every lab on this many ranks instead of the notebook's (a lab needing a fixed count, the 3D
    one, keeps its own)."""
    from labkit.runtime import pool, system
    from labkit.runtime.launch import LabError, run_lab

    rows = []
    t0 = time.monotonic()
    try:
        warmed = pool.warm(preload=["transformers"], wait=True)
        rows.append(Check("lab: warm pool", "ok" if warmed else "info",
                          f"imports torch and transformers once, {time.monotonic() - t0:.1f} s"
                          if warmed else "no warm pool here (not Linux): labs use torchrun",
                          data={"seconds": time.monotonic() - t0}))
    except Exception as exc:       # the labs still run under torchrun
        rows.append(Check("lab: warm pool", "warn", f"the warm pool did not start: {exc}",
                          "labs fall back to torchrun (slower starts)"))
    failed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="labkit-workshop-") as tmp:
        for run in runs:
            if progress:
                progress(run)
            n = run.nproc if (nproc is None or run.lab == "threed") else nproc
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
            except ValueError as exc:       # more ranks than this machine holds, ...
                seconds, error, r = time.monotonic() - t, exc, None
            # what the lab reported, else what its ranks' dist.setup picks for n local ranks
            backend = (r.results[0].get("backend") if r and r.results else None) \
                or system.default_backend(n)
            data.update(seconds=seconds, backend=backend,
                        launcher=getattr(r, "launcher", None))
            if (error is None) == (not run.fails):
                how = "failed as the lesson means it to" if run.fails else "ok"
                on = f"{n} rank{'s' if n != 1 else ''}, {backend}"
                rows.append(Check(name, "ok", f"{on}: {seconds:.1f} s ({how})", data=data))
            else:
                failed.add(run.name)
                first = (str(error).strip().splitlines() or [type(error).__name__])[0] \
                    if error else "it should have failed (its crash did not happen)"
                rows.append(Check(name, "fail", f"{n} ranks: {first}",
                                  f"run `labkit run {run.lab} -n {n} -- {' '.join(run.args)}` "
                                  "to see every rank's output", data=data))
    return rows


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
        warn = (f"; {len(self.warnings)} warning(s): "
                f"{', '.join(c.name for c in self.warnings)}") if self.warnings else ""
        return f"{self.host}: READY{' with warnings' if warn else ''}: {where}; {took}{warn}"

    def to_dict(self) -> dict:
        return {"host": self.host, "ok": self.ok, "verdict": self.verdict(), "gpus": self.gpus,
                "machine": self.machine,
                "seconds": self.seconds, "lab_seconds": self.lab_times(),
                "checks": [asdict(c) for c in self.checks]}

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


def preflight(runs: list[LabRun] | None = None, nproc: int | None = None,
              timeout: float = 600.0, progress=None) -> Preflight:
    """Every check of this machine, then each run of `runs` (default: one per lab program)."""
    t0 = time.monotonic()
    runs = select_labs() if runs is None else runs
    gpu_row, gpus = check_gpus()
    inter = check_interconnect(gpus)
    checks = [doctor.check_python(), doctor.check_torch(), *doctor.check_cpu_ram(), gpu_row,
              check_nccl(gpus), inter, check_busbw(gpus, inter, timeout), check_disk(),
              doctor.check_port()]
    checks += run_labs(runs, timeout=timeout, nproc=nproc, progress=progress)
    return Preflight(platform.node() or "this machine", checks, gpus, len(runs),
                     time.monotonic() - t0, host_env())


# --- the budget --------------------------------------------------------------------------------

@dataclass
class Budget:
    learners: int
    gpus_per_learner: int
    repeats: float
    lab_seconds: float           # one learner's labs, run once each
    compute_gpu_hours: float     # learners x GPUs x labs' time x repeats
    reserved_gpu_hours: float | None = None   # learners x GPUs x session hours (what is billed)
    cost: float | None = None
    rows: list[dict] = field(default_factory=list)


def gpu_hours(learners, lab_seconds: dict, gpus_per_learner=1, repeats=1.0,
              session_hours=None, price_per_gpu_hour=None) -> Budget:
    """GPU-hours a workshop needs, from measured lab times.

    lab_seconds: {lab run: wall seconds of one run} (a preflight's `lab_times()`). Each learner
    holds `gpus_per_learner` GPUs while their labs run, and runs each lab `repeats` times (re-runs
    after a fix): compute = learners x gpus_per_learner x sum(lab_seconds) x repeats / 3600.
    session_hours: when each learner keeps the machine for the whole session (the usual cloud
    case), reserved = learners x gpus_per_learner x session_hours, the figure billed.
    price_per_gpu_hour: cost = the billed figure (reserved if given, else compute) x price."""
    n = validate.positive_int("learners", learners)
    g = validate.positive_int("gpus_per_learner", gpus_per_learner)
    rep = validate.positive("repeats", repeats)
    if not isinstance(lab_seconds, dict) or not lab_seconds:
        raise ValueError("lab_seconds must be a non-empty dict {lab: seconds}; e.g. a "
                         "preflight's lab_times() or `labkit workshop check --json`'s lab_seconds")
    for k, s in lab_seconds.items():
        validate.non_negative(f"lab_seconds[{k!r}]", s)
    total = float(sum(lab_seconds.values()))
    compute = n * g * total * rep / 3600
    reserved = None
    if session_hours is not None:
        reserved = n * g * validate.positive("session_hours", session_hours)
        if reserved < compute:
            raise ValueError(f"session_hours={session_hours} is shorter than the labs' own "
                             f"time ({total * rep / 3600:.2f} h per learner with repeats={rep:g});"
                             " allowed: a session at least that long")
    cost = None
    if price_per_gpu_hour is not None:
        price = validate.non_negative("price_per_gpu_hour", price_per_gpu_hour)
        cost = (reserved if reserved is not None else compute) * price
    rows = [{"lab": k, "seconds": float(s),
             "gpu_hours": n * g * float(s) * rep / 3600} for k, s in lab_seconds.items()]
    return Budget(n, g, rep, total, compute, reserved, cost, rows)


def format_budget(b: Budget) -> str:
    lines = [f"{'lab':<20}{'s per run':>10}{'GPU-h, all learners':>22}"]
    lines += [f"{r['lab']:<20}{r['seconds']:>10.1f}{r['gpu_hours']:>22.3f}" for r in b.rows]
    lines += ["", f"{b.learners} learners x {b.gpus_per_learner} GPU(s) x "
                  f"{b.lab_seconds:.0f} s of labs x {b.repeats:g} repeat(s) / 3600 = "
                  f"{b.compute_gpu_hours:.2f} GPU-hours running labs"]
    if b.reserved_gpu_hours is not None:
        lines.append(f"reserved for the session: {b.reserved_gpu_hours:.1f} GPU-hours "
                     f"(each learner holds {b.gpus_per_learner} GPU(s) throughout; billed)")
    if b.cost is not None:
        lines.append(f"cost: {b.cost:,.2f} (at the price per GPU-hour given)")
    return "\n".join(lines)


def host_env() -> dict:
    """The machine's cores and load when it measured (another job on the cores slows labs)."""
    return {"cores": os.cpu_count(), "load_1min": os.getloadavg()[0]
            if hasattr(os, "getloadavg") else None}
