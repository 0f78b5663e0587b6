"""The README's SLURM script, run for real: sbatch submits it to a one-node SLURM cluster that the
test starts on this machine, and every rank of the hello lab must report.

The cluster (munged, slurmctld and slurmd as subprocesses of the test, in a temporary directory,
on free ports) needs Debian's slurm-wlm and munge and root. Without them the cluster tests skip
and say what to install; with them, a cluster that does not come up fails with the daemon's log.

What the README's script gets here and a real cluster would give it otherwise, all outside the
script: `--nodes=1` on sbatch's command line (one machine), 8 GPUs of GRES whose device files are
/dev/null (Slurm 22.05 drops GPUs without a device file), LABKIT_OVERSUBSCRIBE=1 (8 ranks on 2
cores) and LABKIT_LAUNCHER=torchrun (on one node labkit would fork its ranks from its pool, which
has no rendezvous; on two nodes it always runs torchrun, which is what the script is for), and
`--output` in the test's directory rather than slurm-ID.out in the checkout.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proctools import MARK, kill_marked, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INSTALL = "apt-get install slurm-wlm munge"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
# Log lines that mean this machine does not let the daemons run (a skip), not that the
# configuration or Slurm is broken (a failure).
ENVIRONMENTAL = re.compile(r"Permission denied|Operation not permitted|Address already in use")
UP_LIMIT = 30.0        # seconds for the node to come up idle on a loaded 2-core machine
JOB_LIMIT = 120.0      # seconds for one job, start to end
multirank = pytest.mark.multirank


# --- the README's script ------------------------------------------------------------------------

def readme_script() -> str:
    """The ```bash block right after the README's "**SLURM.**" paragraph."""
    lines = README.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("**SLURM.**")]
    if len(starts) != 1:
        pytest.fail(f"README.md has {len(starts)} lines starting with '**SLURM.**'; this test "
                    "runs the bash block after that paragraph: allowed: exactly one such line")
    i = starts[0]
    while i < len(lines) and lines[i].strip():          # the rest of the paragraph
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i == len(lines) or lines[i].strip() != "```bash":
        pytest.fail("README.md: the '**SLURM.**' paragraph is not followed by a ```bash block; "
                    "this test submits that block to sbatch: allowed: paragraph, blank line, "
                    "```bash block")
    end = lines.index("```", i + 1) if "```" in lines[i + 1:] else None
    if end is None:
        pytest.fail("README.md: the ```bash block after '**SLURM.**' is not closed by ```")
    return "\n".join(lines[i + 1:end]) + "\n"


def rdzv_port(script: str) -> int | None:
    """The port of the script's --rdzv-endpoint ("$head:29500"), if it names one."""
    found = re.search(r'--rdzv-endpoint\s+"?\$\{?\w+\}?:(\d+)', script)
    return int(found.group(1)) if found else None


def test_readme_has_an_sbatch_script():
    script = readme_script()
    assert script.startswith("#!/bin/bash\n"), script
    assert re.search(r"^#SBATCH --nodes=\d+$", script, re.M), "no #SBATCH --nodes= line"
    assert re.search(r"^srun .*labkit run hello", script, re.M), "no `srun ... labkit run hello`"
    assert rdzv_port(script), "no --rdzv-endpoint \"$HOST:PORT\" in the script"


# --- a one-node cluster -------------------------------------------------------------------------

@dataclass
class Job:
    id: str
    mark: str            # MARK=mark is in the environment of every process of the job
    output: Path


@dataclass
class Cluster:
    dir: Path
    host: str
    env: dict            # SLURM_CONF for the commands (sbatch, sinfo, ...) and the jobs
    daemons: dict = field(default_factory=dict)        # name -> Popen
    jobs: list = field(default_factory=list)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)

    def log(self, name: str, lines: int = 15) -> str:
        path = self.dir / f"{name}.out"
        text = path.read_text(errors="replace") if path.exists() else "(no output)"
        return "\n".join(text.splitlines()[-lines:])

    def check_daemons(self) -> None:
        """Skip or fail, with its log, if a daemon has exited: none may while the tests run."""
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                tail = self.log(name)
                why = [line for line in tail.splitlines() if ENVIRONMENTAL.search(line)]
                if why:
                    pytest.skip(f"{name} cannot run on this machine: {why[-1].strip()}")
                pytest.fail(f"{name} exited with code {proc.returncode}; its last lines "
                            f"({self.dir}/{name}.out):\n{tail}")

    def submit(self, script: Path, *options: str, export: dict | None = None) -> Job:
        """sbatch the script from the checkout (its working directory, as for a learner)."""
        mark = uuid.uuid4().hex
        exports = ",".join(f"{k}={v}" for k, v in {**(export or {}), MARK: mark}.items())
        proc = self.run("sbatch", "--parsable", f"--output={self.dir}/job-%j.out",
                        f"--export=ALL,{exports}", *options, str(script))
        if proc.returncode != 0:
            self.check_daemons()
            pytest.fail(f"sbatch refused {script.name}: {proc.stderr.strip()}")
        job_id = proc.stdout.strip().split(";")[0]          # "ID" or "ID;CLUSTER"
        job = Job(job_id, mark, self.dir / f"job-{job_id}.out")
        self.jobs.append(job)
        return job

    def state(self, job: Job) -> dict[str, str]:
        proc = self.run("scontrol", "show", "job", "-o", job.id)
        if proc.returncode != 0:
            self.check_daemons()
            pytest.fail(f"scontrol show job {job.id}: {proc.stderr.strip()}")
        return dict(w.split("=", 1) for w in proc.stdout.split() if "=" in w)

    def wait(self, job: Job, limit: float = JOB_LIMIT) -> dict[str, str]:
        """The job's record once it has ended; cancelled and a failure after `limit` s."""
        t0 = time.monotonic()
        while (state := self.state(job))["JobState"] not in FINAL_STATES:
            if time.monotonic() - t0 > limit:
                self.run("scancel", job.id)
                pytest.fail(f"job {job.id} still {state['JobState']} after {limit:.0f} s "
                            f"(cancelled); its output:\n{read(job.output)}")
            time.sleep(0.25)
        return state

    def assert_nothing_left(self, job: Job) -> None:
        """No process of the job, and no slurmstepd of this cluster, outlives the job."""
        _, left = wait_until_gone(job.mark, 15)
        assert left == [], f"processes of job {job.id} outlived it: {commands(left)}"
        t0 = time.monotonic()
        while (stepds := slurmstepds(self.dir)) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert stepds == [], f"slurmstepd outlived job {job.id}: {commands(stepds)}"


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"(no file {path})"


def commands(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            out.append(f"{pid}: (gone)")
    return out


def slurmstepds(cluster_dir: Path) -> list[int]:
    """slurmstepd processes of this cluster: they leave slurmd (their parent becomes init) and
    drop its environment, but keep its working directory, the cluster's."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() != "slurmstepd":
                    continue
            if os.readlink(f"/proc/{entry}/cwd") == str(cluster_dir):
                found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def unavailable() -> str | None:
    """Why this machine cannot start the cluster (a skip), or None."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (f"needs SLURM and MUNGE: {', '.join(missing)} not on PATH; install with "
                f"`{INSTALL}` (as root; the daemons land in /usr/sbin, which must be on PATH)")
    if os.geteuid() != 0:
        return ("needs root: the test starts munged, slurmctld and slurmd itself and slurmd "
                f"runs jobs as their user (`sudo pytest`, or CI's .ci/run, which also runs "
                f"`{INSTALL}`)")
    return None


def free_ports(n: int) -> list[int]:
    """n distinct ports free now (all held open while picked, so none is picked twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_line() -> str:
    """This machine as slurmd sees it (`slurmd -C`): a node configured with more CPUs or another
    layout than slurmd finds is drained. RealMemory is left out: memory is not scheduled."""
    proc = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30)
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    if proc.returncode != 0 or not first.startswith("NodeName="):
        pytest.fail(f"`slurmd -C` did not describe this machine:\n{proc.stdout}{proc.stderr}")
    return " ".join(w for w in first.split() if not w.startswith("RealMemory="))


def write_config(d: Path, node: str, host: str) -> None:
    ctld_port, slurmd_port = free_ports(2)
    for i in range(8):        # gres/gpu needs device files; /dev/null is one (a char device)
        (d / f"gpu{i}").symlink_to("/dev/null")
    (d / "gres.conf").write_text(f"NodeName={host} Name=gpu File={d}/gpu[0-7]\n")
    (d / "slurm.conf").write_text(f"""\
ClusterName=labkit-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
MailProg=/bin/true
# no cgroups in a container: processes are tracked by parent, tasks are not bound to CPUs
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=5
GresTypes=gpu
{node} NodeAddr=127.0.0.1 Gres=gpu:8 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")


def start(cluster: Cluster, name: str, *cmd: str) -> None:
    # Each daemon runs in the foreground (-D/-F), a child of the test: stopping it is a signal.
    with open(cluster.dir / f"{name}.out", "wb") as out:
        cluster.daemons[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cluster.dir, env=cluster.env)


def wait_for(cluster: Cluster, what: str, ready) -> None:
    t0 = time.monotonic()
    while not ready():
        cluster.check_daemons()
        if time.monotonic() - t0 > UP_LIMIT:
            logs = "\n".join(f"--- {n}:\n{cluster.log(n)}" for n in cluster.daemons)
            pytest.fail(f"{what} not within {UP_LIMIT:.0f} s; the daemons' last lines:\n{logs}")
        time.sleep(0.2)


def node_idle(cluster: Cluster) -> bool:
    proc = cluster.run("sinfo", "-h", "-N", "-n", cluster.host, "-o", "%T|%E", timeout=15)
    state, _, reason = proc.stdout.strip().partition("|")
    if state.rstrip("*~#") in ("drained", "draining", "inval", "down") and reason != "none":
        # slurmd registered but slurmctld rejected the node: the configuration is wrong
        pytest.fail(f"node {cluster.host} is {state}: {reason}\n--- slurmd:\n"
                    f"{cluster.log('slurmd')}\n--- slurmctld:\n{cluster.log('slurmctld')}")
    return state == "idle"


def stop(cluster: Cluster) -> None:
    """Jobs cancelled, daemons stopped (SIGTERM, then SIGKILL after 5 s), and what the jobs
    left behind killed: a failing test must not leave ranks or slurmstepd running."""
    if cluster.daemons.get("slurmctld") and cluster.daemons["slurmctld"].poll() is None:
        try:
            cluster.run("scancel", "--user=root", timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for name in ("slurmd", "slurmctld", "munged"):
        proc = cluster.daemons.get(name)
        if proc is None or proc.poll() is not None:
            continue
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid in slurmstepds(cluster.dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for job in cluster.jobs:
        kill_marked(job.mark)
    shutil.rmtree(cluster.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    why = unavailable()
    if why:
        pytest.skip(why)
    node = node_line()
    host = node.split()[0].removeprefix("NodeName=")
    d = Path(tempfile.mkdtemp(prefix="labkit-slurm-"))
    d.chmod(0o755)          # munged refuses a socket in a directory others cannot enter
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)        # munged refuses a key others can read
    write_config(d, node, host)
    c = Cluster(d, host, {**os.environ, "SLURM_CONF": str(d / "slurm.conf")})
    try:
        start(c, "munged", "munged", "-F", f"--key-file={key}", f"--socket={d}/munge.sock",
              f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
              f"--log-file={d}/munged.log")
        wait_for(c, "munged's socket", (d / "munge.sock").exists)
        start(c, "slurmctld", "slurmctld", "-D", "-f", str(d / "slurm.conf"))
        start(c, "slurmd", "slurmd", "-D", "-f", str(d / "slurm.conf"))
        wait_for(c, f"node {host} idle in sinfo", lambda: node_idle(c))
        yield c
    finally:
        stop(c)


# --- the tests ----------------------------------------------------------------------------------

def rank_lines(output: str) -> list[tuple[int, int, float, float]]:
    """(rank, world size, all_reduce, expected) of each hello line in the job's output."""
    found = re.findall(r"^\[rank \d+\] rank (\d+) of (\d+) on \S+: .*all_reduce\(rank \+ 1\) = "
                       r"(\S+) \(expected (\S+)\)$", output, re.M)
    return sorted((int(r), int(n), float(v), float(e)) for r, n, v, e in found)


@multirank
def test_readme_sbatch_script_runs_hello_on_8_ranks(cluster):
    script = readme_script()
    port = rdzv_port(script)
    with socket.socket() as s:          # the script's rendezvous port is fixed
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as exc:
            pytest.skip(f"port {port}, the README script's rendezvous port, is in use on this "
                        f"machine ({exc})")
    path = cluster.dir / "readme.sbatch"
    path.write_text(script)
    job = cluster.submit(path, "--nodes=1",
                         export={"LABKIT_OVERSUBSCRIBE": "1", "LABKIT_LAUNCHER": "torchrun"})
    state = cluster.wait(job)
    output = read(job.output)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), output
    # it ran, so its 8 GPUs per node were granted
    assert (state["NumNodes"], state["TresPerNode"]) == ("1", "gres:gpu:8"), state
    assert rank_lines(output) == [(r, 8, 36.0, 36.0) for r in range(8)], output
    assert "finished on 8 rank(s)" in output and "(torchrun)" in output, output
    cluster.assert_nothing_left(job)


@multirank
def test_failing_rank_fails_the_job_and_is_named(cluster):
    path = cluster.dir / "fail.sbatch"
    path.write_text("#!/bin/bash\n#SBATCH --ntasks-per-node=1\n"
                    "srun .venv/bin/labkit run tests/fixtures/labs/raise_on_rank.py -n 2 "
                    "-- --rank 1\n")
    job = cluster.submit(path)
    state = cluster.wait(job)
    output = read(job.output)
    # labkit run exits 1 when a rank fails; srun passes it on, and the script's last command
    # is the job's exit status
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "1:0"), output
    assert "rank 1 raised ValueError: boom on rank 1" in output, output
    cluster.assert_nothing_left(job)
