"""No lab outlives the kernel that started it (labkit.runtime.guard).

A notebook kernel starts a 2-rank lab whose ranks sleep without printing; the kernel is then
restarted, shut down or killed with SIGKILL while the lab runs, and every process of the lab
(torchrun or the kernel's warm pool, and both ranks) must be gone within 10 s. With the guard
switched off the same lab survives: that case shows the test can fail, and why the guard
exists. Every case runs on both launchers.
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from proctools import MARK, kill_marked, processes_marked, wait_until_gone

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LAB = Path(__file__).resolve().parents[1] / "fixtures" / "labs" / "sleep_silent.py"
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 10.0           # seconds the lab's processes may outlive the kernel


def pool_processes(kernel_pid: int) -> list[int]:
    """The warm parent (labkit.runtime.zygote) a kernel started, and what it forked."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"labkit.runtime.zygote" in argv and argv[argv.index(b"labkit.runtime.zygote") + 2] \
                == str(kernel_pid).encode():
            found.append(int(entry))
    return [p for p in found if processes_alive(p)]


def processes_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def start_lab_in_kernel(tmp_path, mark: str, launcher: str, guard: bool = True):
    from jupyter_client import KernelManager

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not guard:
        env["LABKIT_ORPHAN_GUARD"] = "0"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(ROOT), env=env)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    marker = tmp_path / "rank"
    kc.execute(
        "from labkit import run_lab\n"
        f"run_lab({str(LAB)!r}, nproc=2, timeout=600, quiet=True, launcher={launcher!r}, env="
        f"{{{MARK!r}: {mark!r}, 'LABKIT_TEST_MARKER': {str(marker)!r}, 'LABKIT_TEST_SLEEP': '300'}})\n")
    deadline = time.monotonic() + 120          # imports on a loaded 2-core machine are slow
    while time.monotonic() < deadline:
        if all(Path(f"{marker}.{r}").exists() for r in (0, 1)):
            break
        time.sleep(0.1)
    else:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        kill_marked(mark)
        pytest.fail("the lab's ranks did not start within 120 s")
    alive = processes_marked(mark)
    # torchrun and 2 ranks; the pool's ranks carry the mark, its warm parent does not
    assert len(alive) >= (3 if launcher == "torchrun" else 2), f"found pids {alive}"
    if launcher == "pool":
        assert pool_processes(km.provisioner.pid), "the kernel has no warm pool"
    return km, kc


def end_kernel(km, how: str) -> None:
    if how == "restart":
        km.restart_kernel(now=False)          # what Kernel > Restart does
    elif how == "shutdown":
        km.shutdown_kernel(now=False)         # what Kernel > Shut Down does
    elif how == "kill -9":
        os.kill(km.provisioner.pid, signal.SIGKILL)
    else:
        raise ValueError(how)




@pytest.mark.parametrize("how", ["restart", "shutdown", "kill -9"])
def test_lab_dies_with_its_kernel(tmp_path, how, launcher):
    mark = uuid.uuid4().hex
    km, kc = start_lab_in_kernel(tmp_path, mark, launcher)
    kernel = km.provisioner.pid
    try:
        t0 = time.monotonic()
        end_kernel(km, how)
        returned = time.monotonic() - t0
        after, left = wait_until_gone(mark, LIMIT)
        print(f"\n{how}: the kernel call took {returned:.2f} s; the lab's processes were gone "
              f"{after:.2f} s after it ({returned + after:.2f} s from the start of the {how})")
        assert left == [], f"after the kernel's {how}, pids {left} were still alive {LIMIT:g} s later"
        deadline = time.monotonic() + LIMIT
        while pool_processes(kernel) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool_processes(kernel) == [], f"the warm pool outlived its kernel's {how}"
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        kill_marked(mark)


def test_without_the_guard_the_lab_outlives_a_killed_kernel(tmp_path, launcher):
    mark = uuid.uuid4().hex
    km, kc = start_lab_in_kernel(tmp_path, mark, launcher, guard=False)
    try:
        end_kernel(km, "kill -9")
        time.sleep(3.0)
        left = processes_marked(mark)
        assert len(left) >= (3 if launcher == "torchrun" else 2), (
            "without the guard the ranks (and torchrun) should survive the kernel (that is the "
            f"bug the guard fixes); alive: {left}")
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        kill_marked(mark)
        assert wait_until_gone(mark, 10)[1] == []


@pytest.mark.parametrize("wait", ["pidfd", "polling"])
def test_rank_watchdog_stops_the_rank_when_the_launcher_dies(wait):
    """The rank side alone (no death signal from torchrun): a process that called
    guard.protect_rank() goes when the launcher it watches goes, by a pidfd or (macOS, old
    kernels) by polling."""
    import subprocess
    import sys

    mark = uuid.uuid4().hex
    rank = ("import os, sys, time\n"
            + ("del os.pidfd_open\n" if wait == "polling" else "")
            + "from labkit.runtime import guard\n"
            "assert guard.protect_rank()\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    launcher = ("import os, subprocess, sys, time\n"
                "from labkit.runtime import guard\n"
                f"env = {{**os.environ, **guard.launcher_env(), {MARK!r}: {mark!r}}}\n"
                f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], env=env, "
                "start_new_session=True, stdout=subprocess.PIPE, text=True)\n"
                "print(p.stdout.readline().strip(), flush=True)\n"
                "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert len(processes_marked(mark)) == 1
        proc.kill()
        proc.wait()
        after, left = wait_until_gone(mark, 5.0)
        assert left == [], f"the rank outlived its launcher by more than 5 s ({wait})"
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(mark)


def test_guard_refuses_an_orphaned_start_and_bad_usage():
    """The guard checks its parent after asking for the death signal: started for a parent
    that is not its parent (as if that one had just died), it exits instead of running."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "labkit.runtime.guard", "1", "--", "/bin/echo",
                          "should not run"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "should not run" not in out.stdout
    out = subprocess.run([sys.executable, "-m", "labkit.runtime.guard", str(os.getpid())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "usage" in out.stderr
    ok = subprocess.run([sys.executable, "-m", "labkit.runtime.guard", str(os.getpid()), "--",
                         "/bin/echo", "ran"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "ran"
