"""`labkit doctor`: one screen that says whether this machine is ready for the course.

Each check returns a `Check` with a status:
- ok:   present and working;
- info: a fact (e.g. "no GPU: labs run on CPU over gloo"), never a problem;
- warn: works, but something a learner should know (e.g. fewer cores than ranks);
- fail: a missing piece; `fix` says what to do. Any fail makes the exit code non-zero.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
import importlib.metadata as md
import os
from pathlib import Path
import platform
import shutil
import subprocess
import sys
import time

from labkit.runtime import system

MIN_PYTHON = (3, 10)
WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"
SETUP_FIX = "run `make lab` (or `make test`) from the checkout: it creates .venv and installs everything"


@dataclass
class Check:
    name: str
    status: str  # "ok" | "info" | "warn" | "fail"
    detail: str
    fix: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class Report:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def __getitem__(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; checks: {', '.join(c.name for c in self.checks)}")

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks]}

    def text(self) -> str:
        mark = {"ok": "ok  ", "info": "--  ", "warn": "WARN", "fail": "FAIL"}
        width = max(len(c.name) for c in self.checks)
        lines = ["labkit doctor: is this machine ready for the Distributed Training Lab?", ""]
        for c in self.checks:
            detail = c.detail.replace("\n", "\n" + " " * (width + 9))
            lines.append(f"  [{mark[c.status]}] {c.name:<{width}}  {detail}")
            if c.status == "warn" and c.fix:
                lines.append(" " * (width + 11) + f"what to do: {c.fix}")
        lines.append("")
        if self.ok:
            lines.append("Ready: every lab of the course can run here.")
        else:
            lines.append(f"Not ready: {len(self.failures)} missing piece(s):")
            for c in self.failures:
                lines.append(f"  - {c.name}: {c.fix or c.detail}")
        return "\n".join(lines)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check_python() -> Check:
    v = sys.version_info
    detail = f"{platform.python_version()} ({sys.executable})"
    if v[:2] < MIN_PYTHON:
        return Check("python", "fail", detail, f"use Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer (3.11 recommended)")
    return Check("python", "ok", detail)


def check_torch() -> Check:
    try:
        import torch
    except ImportError:
        return Check("torch", "fail", "not installed", "pip install torch==2.13.0 (or " + SETUP_FIX + ")")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    return Check("torch", "ok", f"{torch.__version__} ({build} build)",
                 data={"version": torch.__version__, "cuda": torch.version.cuda})


def check_gpus() -> Check:
    try:
        import torch
    except ImportError:
        return Check("gpus", "info", "unknown (torch missing)")
    n = system.cuda_device_count()
    if n == 0:
        why = "CPU build of torch" if not torch.version.cuda else "no CUDA device visible"
        return Check("gpus", "info", f"none ({why}): labs run on CPU over gloo", data={"count": 0})
    gpus = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                     "compute_capability": f"{p.major}.{p.minor}"})
    lines = [f"{n} GPU(s)"] + [
        f"cuda:{g['index']} {g['name']}, {g['memory_bytes'] / 1e9:.1f} GB ({g['memory_bytes'] / 2**30:.1f} GiB), "
        f"compute capability {g['compute_capability']}" for g in gpus]
    return Check("gpus", "ok", "\n".join(lines), data={"count": n, "gpus": gpus})


NO_SMI = "nvidia-smi not found (no NVIDIA driver here)"


def nvidia_smi(*args: str, timeout: float = 30) -> tuple[str | None, str | None]:
    """(stdout, None) of `nvidia-smi ARGS`, or (None, why not): not installed, failed to run,
    or a non-zero exit with its stderr."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, NO_SMI
    what = " ".join(["nvidia-smi", *args])
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{what} failed: {exc}"
    if out.returncode != 0:
        return None, f"{what} exited {out.returncode}: {out.stderr.strip()}"
    return out.stdout, None


def check_topology() -> Check:
    text, why = nvidia_smi("topo", "-m", timeout=20)
    if text is None:
        return Check("gpu topology", "info" if why == NO_SMI else "warn", why)
    return Check("gpu topology", "ok", "nvidia-smi topo -m\n" + text.rstrip(), data={"topo": text})


def check_backends() -> list[Check]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return [Check("gloo", "fail", "torch missing", SETUP_FIX)]
    checks = []
    if not dist.is_available():
        return [Check("gloo", "fail", "torch.distributed is not available in this torch build",
                      "install a torch build with distributed support: pip install torch==2.13.0")]
    gloo = dist.is_gloo_available()
    checks.append(Check("gloo", "ok" if gloo else "fail", "available" if gloo else "missing",
                        "" if gloo else "install a torch build with gloo: pip install torch==2.13.0"))
    if dist.is_nccl_available() and torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        ver = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        checks.append(Check("nccl", "ok", f"available, version {ver}", data={"version": ver}))
    elif dist.is_nccl_available():
        checks.append(Check("nccl", "info", "built in, but no GPU visible: labs use gloo"))
    else:
        checks.append(Check("nccl", "info", "not available (CPU build of torch): labs use gloo"))
    return checks


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def check_cpu_ram() -> list[Check]:
    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    cpu = Check("cpu cores", "ok", f"{usable} usable ({cores} in the machine)", data={"cores": usable})
    mem = _meminfo()
    if not mem:
        return [cpu, Check("ram", "info", "unknown (no /proc/meminfo)")]
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    # A 4-rank lab with transformers holds about 4 x 0.4 GB; below 4 GB available it gets tight.
    status = "ok" if avail >= 4e9 else "warn"
    detail = (f"{total / 1e9:.1f} GB total ({total / 2**30:.1f} GiB), "
              f"{avail / 1e9:.1f} GB available ({avail / 2**30:.1f} GiB)")
    return [cpu, Check("ram", status, detail, "" if status == "ok" else "close other programs: labs want ~4 GB free",
                       data={"total_bytes": total, "available_bytes": avail})]


def _proc_text(pid: str, name: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace")
    except OSError:                  # gone, or another user's
        return None


def _held_bytes(pid: str) -> tuple[int, str] | None:
    """(bytes, "PSS" or "RSS"): PSS shares each page among the processes that map it (forked
    ranks share the warm parent's torch), so the sum over processes is what they hold."""
    for name, key, kind in (("smaps_rollup", "Pss:", "PSS"), ("status", "VmRSS:", "RSS")):
        for line in (_proc_text(pid, name) or "").splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024, kind
    return None


def _is_zygote(argv: list[str]) -> bool:
    return "labkit.runtime.zygote" in argv


def course_processes(root: Path | None = None) -> dict[str, list[dict]]:
    """The course's Jupyter kernels (ipykernel started in the checkout `root`, or by its .venv)
    and warm pools (labkit.runtime.zygote's warm parents, not their labs' agents and ranks,
    which are forked from them and show the same command line), each {"pid", "bytes", "kind"};
    this user's only (read from /proc: empty where there is none)."""
    from labkit.course.outline import repo_root
    root = (root or repo_root()).resolve()
    found: dict[str, list[dict]] = {"kernels": [], "pools": []}
    procs = {}                                     # pid: (argv, parent pid)
    for pid in os.listdir("/proc") if Path("/proc").is_dir() else []:
        stat = _proc_text(pid, "stat") if pid.isdigit() else None
        if stat:
            argv = (_proc_text(pid, "cmdline") or "").split("\0")
            procs[pid] = (argv, stat.rsplit(")", 1)[1].split()[1])
    for pid, (argv, ppid) in procs.items():
        if _is_zygote(argv) and not _is_zygote(procs.get(ppid, ([], ""))[0]):
            kind = "pools"
        elif any("ipykernel" in a for a in argv[:3]):
            try:
                cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
            except OSError:
                continue
            if not (cwd.is_relative_to(root) or argv[0].startswith(str(root))):
                continue
            kind = "kernels"
        else:
            continue
        held = _held_bytes(pid)
        if held:
            found[kind].append({"pid": int(pid), "bytes": held[0], "kind": held[1]})
    return found


def check_course_memory(root: Path | None = None) -> Check:
    """What this course's Jupyter kernels and warm pools hold now: information (each visited
    notebook keeps a kernel, and each kernel that ran a lab a warm pool, until shut down)."""
    from labkit.runtime import pool
    if not Path("/proc").is_dir():
        return Check("course memory", "info", "unknown (no /proc here)")
    found = course_processes(root)
    kinds = sorted({p["kind"] for ps in found.values() for p in ps}) or ["PSS"]
    parts = []
    for key, one, many in (("kernels", "Jupyter kernel", "Jupyter kernels"),
                           ("pools", "warm pool", "warm pools")):
        n, held = len(found[key]), sum(p["bytes"] for p in found[key])
        parts.append(f"{n} {one if n == 1 else many} {held / 1e9:.2f} GB "
                     f"({held / 2**30:.2f} GiB)")
    try:
        idle = pool.idle_timeout()
        pools = (f"a warm pool leaves after {idle / 60:g} min without a lab" if idle else
                 f"warm pools stay until their kernel ends ({pool.ENV_IDLE}=0)")
    except pool.PoolError as exc:
        pools = str(exc)
    detail = (f"held now by this course ({'/'.join(kinds)}): {parts[0]}, {parts[1]}\n"
              "each notebook opened keeps its kernel: shut down those you are done with "
              f"(Kernel > Shut Down Kernel); {pools}")
    return Check("course memory", "info", detail, data={**found, "measure": "/".join(kinds)})


def check_lab_defaults() -> Check:
    try:
        nproc = system.default_nproc()
        backend = system.default_backend(nproc)
    except (ImportError, ValueError) as exc:
        return Check("lab defaults", "fail", str(exc), SETUP_FIX)
    device = "one GPU per rank" if backend == "nccl" else "CPU"
    return Check("lab defaults", "ok", f"{nproc} ranks per node, backend {backend} on {device}",
                 data={"nproc": nproc, "backend": backend})


def check_launch(nproc: int = 2, timeout: float = 120.0, launcher: str | None = None) -> Check:
    """Start `nproc` local ranks with the hello lab and check their all-reduce. launcher: None
    for run_lab's default (the warm pool on Linux), or "torchrun" (the multi-node path)."""
    name = f"{nproc}-rank launch" + (f" ({launcher})" if launcher else "")
    try:
        from labkit.runtime.launch import LabError, run_lab
    except ImportError as exc:
        return Check(name, "fail", f"labkit.runtime.launch cannot be imported: {exc}", SETUP_FIX)
    t0 = time.perf_counter()
    try:
        extra = {"launcher": launcher} if launcher else {}
        result = run_lab("labkit.labs.hello", nproc=nproc, timeout=timeout, quiet=True, **extra)
    except LabError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        how = f" --launcher {launcher}" if launcher else ""
        return Check(name, "fail", f"the hello lab failed: {first}",
                     f"run `labkit run hello -n 2{how}` to see every rank's output")
    seconds = time.perf_counter() - t0
    expected = sum(range(1, nproc + 1))  # each rank contributes rank + 1
    got = [r.get("all_reduce") for r in result.results]
    backend = result.results[0].get("backend") if result.results else "?"
    if got != [expected] * nproc:
        return Check(name, "fail", f"all-reduce gave {got}, expected {expected} on every rank",
                     "report this: the collective returned a wrong sum")
    used = getattr(result, "launcher", launcher or "torchrun")
    via = "from the warm pool" if used == "pool" else "under torchrun"
    return Check(name, "ok", f"{nproc} ranks started {via} and all-reduced over {backend} "
                             f"(sum {expected} on every rank) in {seconds:.1f} s",
                 data={"seconds": seconds, "backend": backend, "launcher": used,
                       "launcher_listens": result.results[0].get("launcher_listens")})


# Variables that say this machine is one of several nodes of a job: SLURM's, and torchrun's
# --nnodes as an environment variable (PET_NNODES, "N" or "MIN:MAX").
MULTI_NODE_VARS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PET_NNODES")


def multi_node(env=None) -> str | None:
    """Why this machine looks like one node of several (e.g. "SLURM_JOB_NUM_NODES=4"), or None:
    a one-machine set-up (a laptop, one workstation or cloud VM)."""
    env = os.environ if env is None else env
    for var in MULTI_NODE_VARS:
        value = env.get(var, "")
        counts = [int(x) for x in value.split(":") if x.strip().isdigit()]
        if counts and max(counts) > 1:
            return f"{var}={value}"
    return None


def check_exposure(launch: Check) -> Check:
    """What the launcher listened on during the launch check. torchrun's rendezvous store
    (torch's TCPStore) binds every interface whatever address it is given: while a lab runs,
    its ports are open to the network, unauthenticated. On one machine (`multi_node`: None)
    that is information: the labs use the warm pool, which binds 127.0.0.1 only, and torchrun
    is the multi-node path; on a node of a multi-node set-up it is a warning with what to do."""
    who = launch.data.get("launcher", "torchrun")
    name = "lab ports" + (f" ({who})" if launch.name.endswith(")") else "")
    listens = launch.data.get("launcher_listens")
    if launch.status != "ok" or listens is None:
        return Check(name, "info", "unknown (the launch check did not run or could not see)")
    if not listens:
        return Check(name, "info", f"unknown (no /proc here to read {who}'s sockets from)")
    open_ = system.exposed([tuple(s) for s in listens])
    shown = ", ".join(f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in sorted(open_))
    if not open_:
        return Check(name, "ok", f"{'the warm pool' if who == 'pool' else who} listened on "
                                 "loopback only", data={"exposed": []})
    seen = (f"while a lab runs, {who}'s rendezvous listens on every interface ({shown}; new "
            "ports each run), reachable from the network without authentication")
    fix = ("on a shared or cloud machine keep inbound ports closed (a cloud security group, or "
           "`ufw default deny incoming`); multi-node labs need their rendezvous port open "
           "between the nodes only")
    nodes = multi_node()
    if nodes is None:
        return Check(name, "info", f"{seen}.\nOne machine (no multi-node job here): nothing "
                     f"to do on a laptop; {fix}", data={"exposed": open_, "multi_node": None})
    return Check(name, "warn", f"{seen} ({nodes}: this is one node of several)", fix,
                 data={"exposed": open_, "multi_node": nodes})


def check_jupyter() -> list[Check]:
    checks = []
    lab, widgets = _version("jupyterlab"), _version("ipywidgets")
    checks.append(Check("jupyterlab", "ok" if lab else "fail", lab or "not installed",
                        "" if lab else SETUP_FIX))
    checks.append(Check("ipywidgets", "ok" if widgets else "fail", widgets or "not installed",
                        "" if widgets else SETUP_FIX))
    try:
        from jupyter_core.paths import jupyter_path
        dirs = [Path(p) / WIDGETS_EXTENSION for p in jupyter_path("labextensions")]
    except ImportError:
        dirs = []
    found = next((d for d in dirs if (d / "package.json").exists()), None)
    if found:
        checks.append(Check("widgets extension", "ok", f"{WIDGETS_EXTENSION} ({found.parent})"))
    else:
        checks.append(Check("widgets extension", "fail", f"{WIDGETS_EXTENSION} not found: calculators will not render",
                            "pip install 'ipywidgets>=8' jupyterlab_widgets in the same environment as JupyterLab"))
    return checks


def check_port() -> Check:
    try:
        port = system.free_port()
    except OSError as exc:
        return Check("free port", "fail", f"cannot bind 127.0.0.1: {exc}",
                     "labs rendezvous on 127.0.0.1; check the loopback interface and firewall")
    return Check("free port", "ok", f"127.0.0.1:{port} can be bound (labs pick their own port)", data={"port": port})


def run_checks(launch: bool = True, nproc: int = 2, timeout: float = 120.0) -> Report:
    """All checks, in the order a person reads them. `launch=False` skips starting ranks."""
    checks = [check_python(), check_torch(), check_gpus(), check_topology(), *check_backends(),
              *check_cpu_ram(), check_course_memory(), check_lab_defaults()]
    if launch:
        started = check_launch(nproc=nproc, timeout=timeout)
        checks += [started, check_exposure(started)]
        if started.data.get("launcher") == "pool":   # the multi-node path works too
            started = check_launch(nproc=nproc, timeout=timeout, launcher="torchrun")
            checks += [started, check_exposure(started)]
    checks += [*check_jupyter(), check_port()]
    return Report(checks)
