"""%ranks / %%ranks in real notebook kernels: what a learner sees in the cell, a kernel's end
(restart, shutdown, kill -9) leaving nothing of its ranks, and two notebooks with a world each
at once. Every kernel carries a mark in its environment (its warm pool and ranks inherit it)."""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from proctools import MARK, kill_marked, processes_marked, wait_until_gone

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 10.0


class Kernel:
    def __init__(self, mark: str):
        from jupyter_client import KernelManager
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(ROOT), env={**os.environ, MARK: mark,
                                                 "OMP_NUM_THREADS": "1"})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 180) -> list[dict]:
        """The cell's outputs (as nbformat has them) once it has finished."""
        outputs = []

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind in ("stream", "display_data", "execute_result", "error"):
                outputs.append({"type": kind, **content})
            elif kind == "update_display_data":      # the live view redrawn in place
                for o in outputs:
                    if o.get("transient", {}).get("display_id") == content.get(
                            "transient", {}).get("display_id"):
                        o["data"] = content["data"]
        self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        return outputs

    def end(self, how: str) -> None:
        if how == "restart":
            self.km.restart_kernel(now=False)
        elif how == "shutdown":
            self.km.shutdown_kernel(now=False)
        else:
            os.kill(self.km.provisioner.pid, signal.SIGKILL)

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


def text(outputs: list[dict], kind: str | None = None) -> str:
    parts = []
    for o in outputs:
        if kind and o["type"] != kind:
            continue
        if o["type"] == "stream":
            parts.append(o["text"])
        elif o["type"] == "error":
            parts.append(f"{o['ename']}: {o['evalue']}\n" + "\n".join(o["traceback"]))
        else:
            parts.append(o["data"].get("text/plain", ""))
    return "\n".join(parts)


def html(outputs: list[dict]) -> str:
    return "\n".join(o["data"].get("text/html", "") for o in outputs if "data" in o)


@pytest.fixture
def kernels():
    made = []

    def make():
        mark = uuid.uuid4().hex
        k = Kernel(mark)
        made.append((k, mark))
        return k, mark
    yield make
    for k, mark in made:
        k.close()
        _, left = wait_until_gone(mark, LIMIT)
        kill_marked(mark)
        assert left == [], f"processes outlived their kernel: {left}"


def test_what_a_learner_sees_and_kill_9_leaves_nothing(kernels):
    k, mark = kernels()
    k.run("%load_ext labkit")
    assert "no ranks are running: start them with `%ranks start -n 4`" in text(
        k.run("%%ranks\n1"))
    out = k.run("%ranks start -n 2")
    assert "started 2 ranks, gloo on cpu" in text(out), out
    assert "already running" in text(k.run("%ranks start -n 2"))
    out = k.run("%%ranks\nx = torch.ones(2) * (rank + 1)\nprint('before', x.tolist())\n"
                "dist.all_reduce(x)\nprint('after', x.tolist())\nx")
    shown = text(out, "display_data")
    for line in ("[rank 0] before [1.0, 1.0]", "[rank 1] before [2.0, 2.0]",
                 "[rank 0] after [3.0, 3.0]", "[rank 1] after [3.0, 3.0]"):
        assert line in shown, shown
    assert shown.count("all_reduce 1\u00d7 8 B") == 2 and "peak RSS" in shown, shown
    columns = html(out)
    assert "rank 0</div>" in columns and "rank 1</div>" in columns and "grid" in columns
    assert "tensor([3., 3.])" in text(out, "execute_result")
    assert text(k.run("_ranks[1].tolist()"), "execute_result") == "[3.0, 3.0]"
    err = text(k.run("%%ranks 1\nraise KeyError('nope')"))
    assert "RanksError" in err and "rank 1 raised KeyError: 'nope'" in err, err
    assert "%%ranks cell" in err and "line 1" in err
    assert "not in this world of 2" in text(k.run("%%ranks 5\n1"))
    status = text(k.run("%ranks status"))
    assert "1: ok" in status and "2: raised KeyError" in status, status
    before = text(k.run("%ranks status"))
    assert "started again: 2 ranks" in text(k.run("%ranks restart"))
    assert text(k.run("%ranks status")) != before      # new pids, no cell yet
    assert "NameError" in text(k.run("%%ranks 0\nx"))    # names went with the old ranks
    assert len(processes_marked(mark)) >= 4          # kernel, warm parent, agent, 2 ranks
    k.end("kill -9")
    _, left = wait_until_gone(mark, LIMIT)
    assert left == [], f"after kill -9 of the kernel, pids {left} were left"


@pytest.mark.parametrize("how", ["restart", "shutdown"])
def test_the_ranks_end_with_their_kernel(kernels, how):
    k, mark = kernels()
    k.run("%load_ext labkit\n%ranks start -n 2")
    assert "[1]" in text(k.run("%%ranks 1\n[rank]"), "execute_result")
    kernel = k.km.provisioner.pid
    k.end(how)
    deadline = time.monotonic() + LIMIT
    while (left := leftovers(mark, kernel)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], f"after the kernel's {how}, pids {left} were left"


def leftovers(mark: str, kernel: int) -> list[int]:
    """Marked processes, less a kernel that a restart started in place of `kernel`."""
    return [p for p in processes_marked(mark) if p == kernel or not _is_kernel(p)]


def _is_kernel(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ipykernel_launcher" in f.read()
    except OSError:
        return False


def test_two_notebooks_have_a_world_each(kernels):
    (a, _), (b, _) = kernels(), kernels()
    for k, n in ((a, 2), (b, 3)):
        k.kc.execute(f"%load_ext labkit\n%ranks start -n {n}")
    for k in (a, b):
        k.run("1")                                   # both started, at the same time
    cell = "%%ranks\nimport os\nx = torch.tensor([float(rank + 1)])\ndist.all_reduce(x)\n" \
           "(x.item(), world_size, os.getpid())"
    ids_a = a.kc.execute(cell)
    ids_b = b.kc.execute(cell)                       # both cells run at once
    del ids_a, ids_b
    va = text(a.run("sorted(_ranks.values())"), "execute_result")
    vb = text(b.run("sorted(_ranks.values())"), "execute_result")
    got_a, got_b = eval(va), eval(vb)                 # noqa: S307 (our own kernels' reprs)
    assert [(s, n) for s, n, _ in got_a] == [(3.0, 2)] * 2
    assert [(s, n) for s, n, _ in got_b] == [(6.0, 3)] * 3
    assert {p for *_, p in got_a}.isdisjoint({p for *_, p in got_b})
    assert "stopped 2 ranks" in text(a.run("%ranks stop"))
    assert text(b.run("%%ranks 0\nworld_size"), "execute_result").endswith("{0: 3}")
