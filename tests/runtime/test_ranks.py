"""Ranks that stay (labkit.runtime.world, the %ranks / %%ranks magics).

One world of 3 ranks serves the tests that keep it usable (module fixture); the tests that end a
world (a hang, an interrupt) or a kernel start their own. Every world carries a mark, and none
of its processes may outlive its test. Timings are never asserted: a busy laptop must pass.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from proctools import MARK, kill_marked, processes_marked, wait_until_gone

from labkit.runtime.world import RanksError, World

pytestmark = [pytest.mark.multirank]
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 10.0           # seconds a world's processes may outlive its end


def new_world(nproc: int, **kw) -> tuple[World, str]:
    mark = uuid.uuid4().hex
    return World(nproc, env={MARK: mark}, **kw).start(show=lambda *a: None), mark


def stop_and_check(world: World, mark: str) -> None:
    world.stop()
    _, left = wait_until_gone(mark, LIMIT)
    kill_marked(mark)
    assert left == [], f"processes of the world outlived its stop: {left}"


@pytest.fixture(scope="module")
def world():
    w, mark = new_world(3, timeout=120)
    yield w
    stop_and_check(w, mark)


def lines_of(world: World):
    seen: list[tuple[int, str, str]] = []
    return seen, (lambda r, text, dest: seen.append((r, text, dest)))


# --- a world that stays usable ------------------------------------------------------------------

def test_names_stay_and_values_come_back(world):
    seen, show = lines_of(world)
    r = world.run("x = torch.ones(2) * (rank + 1)\nprint('before', x.tolist())\n"
                  "dist.all_reduce(x)\nprint('after', x.tolist())\nx", show=show)
    assert sorted(r.values) == [0, 1, 2]
    assert all(v.tolist() == [6.0, 6.0] for v in r.values.values())
    for rank in range(3):            # each rank's lines, in its own order, told apart
        assert [t for q, t, _ in seen if q == rank] == [f"before {[rank + 1.0] * 2}",
                                                        "after [6.0, 6.0]"]
        assert r.by_rank[rank].output == [f"before {[rank + 1.0] * 2}", "after [6.0, 6.0]"]
    # the next cell sees x; and a cell on some ranks only
    r2 = world.run("y = x.sum().item() + rank\ny", ranks=[0, 2])
    assert dict(r2.values) == {0: 12.0, 2: 14.0}
    with pytest.raises(KeyError, match="rank 1 did not run cell"):
        r2.values[1]
    r3 = world.run("'y' in dir()")          # rank 1 never ran the cell that defined y
    assert dict(r3.values) == {0: True, 1: False, 2: True}


def test_output_comes_back_while_the_cell_runs(world, tmp_path):
    """Rank 0 prints, then waits until the notebook has shown that line (a file the display
    callback writes): were output shown only at the cell's end, it would wait in vain."""
    flag = tmp_path / "seen"

    def show(rank, text, dest):
        if text == "first":
            flag.write_text("yes")
    code = ("import os, time\nif rank == 0:\n    print('first')\n    t0 = time.monotonic()\n"
            f"    while not os.path.exists({str(flag)!r}) and time.monotonic() - t0 < 60:\n"
            "        time.sleep(0.02)\n    print('live' if os.path.exists("
            f"{str(flag)!r}) else 'not live')")
    r = world.run(code, ranks=[0], show=show)
    assert r.by_rank[0].output == ["first", "live"]


def test_each_cell_counts_its_collectives_and_peak_memory(world):
    r = world.run("t = torch.zeros(1000)\ndist.all_reduce(t)\ndist.all_reduce(t)\n"
                  "dist.broadcast(t, src=0)\nbig = torch.ones(16 * 2**20 // 4)\ndel big")
    for rank in range(3):
        rc = r.by_rank[rank]
        assert rc.collectives == {"all_reduce": (2, 8000), "broadcast": (1, 4000)}
        if rc.peak_rss is not None:       # Linux: a 16 MiB tensor came and went in the cell
            assert rc.peak_rss - rc.rss_start >= 15 * 2**20, rc
    quiet = world.run("dist.all_reduce(t)", count=False)
    assert quiet.by_rank[0].collectives is None


def test_gather_and_scatter_count_their_full_buffer(world):
    # nccl-tests' size: every rank's chunk, on every rank (the root's list is empty elsewhere)
    r = world.run("chunk = torch.zeros(5)\nparts = [torch.full((5,), float(i)) for i in "
                  "range(3)] if rank == 0 else None\ndist.scatter(chunk, parts, src=0)\n"
                  "out = [torch.zeros(5) for _ in range(3)] if rank == 0 else None\n"
                  "dist.gather(chunk, out, dst=0)\nchunk")
    assert [r.values[q].tolist() for q in range(3)] == [[float(q)] * 5 for q in range(3)]
    assert all(r.by_rank[q].collectives == {"gather": (1, 60), "scatter": (1, 60)}
               for q in range(3))


def test_a_value_still_in_flight_comes_back_whole(world):
    """A parallelize_module'd layer returns an all-reduce that has not finished (an
    AsyncCollectiveTensor): the value sent back must be the finished one."""
    r = world.run("from torch.distributed.device_mesh import init_device_mesh\n"
                  "from torch.distributed.tensor.parallel import (parallelize_module,\n"
                  "    ColwiseParallel, RowwiseParallel)\n"
                  "torch.manual_seed(0)\nmlp = torch.nn.Sequential(torch.nn.Linear(8, 24), "
                  "torch.nn.GELU(), torch.nn.Linear(24, 8))\nx = torch.randn(64, 8)\n"
                  "ref = mlp(x).detach()\nmesh = init_device_mesh('cpu', (world_size,))\n"
                  "mlp = parallelize_module(mlp, mesh, {'0': ColwiseParallel(), "
                  "'2': RowwiseParallel()})\nmlp(x)")
    refs = world.run("ref")
    for q in range(3):
        assert type(r.values[q]).__name__ == "Tensor"
        assert (r.values[q] - refs.values[q]).abs().max() < 1e-5


def test_a_rank_that_raises_is_named_and_the_world_stays(world):
    world.run("z = rank * 10")
    with pytest.raises(RanksError) as info:
        world.run("if rank == 1:\n    raise ValueError('boom on ' + str(rank))\nz")
    err = info.value
    assert err.reason == "exception" and err.rank == 1 and err.exc_type == "ValueError"
    text = str(err)
    assert "rank 1 raised ValueError: boom on 1" in text
    assert 'File "%%ranks cell' in text and "line 2" in text        # the cell's own line
    assert "rankserver" not in text                                  # not labkit's frames
    assert dict(err.cell.values) == {0: 0, 2: 20}                    # the others' values
    assert dict(world.run("z + 1").values) == {0: 1, 1: 11, 2: 21}    # names kept everywhere


def test_values_that_cannot_come_back_say_why(world):
    r = world.run("class Point:\n    pass\nPoint()")
    with pytest.raises(KeyError, match="cannot be sent to the notebook .* allowed"):
        r.values[0]
    r = world.run("x = 1\nx;")                   # a trailing ';' hides the value, as in IPython
    with pytest.raises(KeyError, match="no value in cell"):
        r.values[0]
    with pytest.raises(ValueError, match="allowed: 0 to 2"):
        world.run("1", ranks=[3])


def test_status_names_each_rank(world):
    from labkit.runtime.ranks_view import status_text
    rows = world.status()
    assert [row["rank"] for row in rows] == [0, 1, 2]
    assert all(row["alive"] and row["pid"] == world.pids[row["rank"]] for row in rows)
    assert all(row["rss"] is None or row["rss"] > 10 * 2**20 for row in rows)
    text = status_text(world)
    assert "3 ranks, gloo on cpu" in text and str(world.pids[2]) in text


# --- worlds that end ------------------------------------------------------------------------------

def test_a_hang_is_diagnosed_and_the_world_started_again():
    world, mark = new_world(2, timeout=120)
    try:
        world.run("x = torch.ones(1)")
        old = dict(world.pids)
        t0 = time.monotonic()
        with pytest.raises(RanksError) as info:
            world.run("if rank == 0:\n    dist.all_reduce(x)\n", timeout=4)
        waited = time.monotonic() - t0
        text = str(info.value)
        assert info.value.reason == "timeout"
        assert "rank 0 still running it" in text
        assert "rank 0 waits in all_reduce (%%ranks cell 2:2 in <module>)" in text
        assert "rank 1 finished the cell, so it never joined all_reduce" in text
        assert waited >= 4
        assert world.restarts == 1 and set(world.pids.values()).isdisjoint(old.values())
        assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in old.values())
        assert dict(world.run("rank").values) == {0: 0, 1: 1}     # the new world works
    finally:
        stop_and_check(world, mark)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


@pytest.mark.parametrize("cell, kept", [("time.sleep(60)", True),
                                         ("if rank == 0:\n    dist.all_reduce(x)", False)])
def test_an_interrupt_stops_the_cell_and_leaves_nothing_behind(cell, kept):
    # pytest-xdist's workers ignore SIGINT; a notebook kernel turns it into KeyboardInterrupt
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    world, mark = new_world(2, timeout=120)
    try:
        world.run("import time\nx = torch.ones(1) * rank")
        pids = dict(world.pids)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            world.run(cell)
        timer.join()
        if kept:                # a sleeping rank stops at once: world and names kept
            assert world.pids == pids and world.restarts == 0
            assert all(world.last_by_rank[r][1].interrupted for r in (0, 1))
            assert dict(world.run("x.item()").values) == {0: 0.0, 1: 1.0}
        else:                   # blocked in a collective: a fresh world, the old one gone
            assert world.restarts == 1 and set(world.pids.values()).isdisjoint(pids.values())
            assert all(_zombie(p) for p in pids.values())
            assert dict(world.run("rank").values) == {0: 0, 1: 1}
    finally:
        signal.signal(signal.SIGINT, old)
        stop_and_check(world, mark)


def test_bad_options_say_what_is_allowed():
    with pytest.raises(ValueError, match="nproc=0"):
        World(0)
    with pytest.raises(ValueError, match="backend"):
        World(2, backend="mpi")
    with pytest.raises(ValueError, match="allowed: backend='gloo' with device='cpu'"):
        World(2, backend="nccl", device="cpu")
    with pytest.raises(RanksError, match="no ranks are running"):
        World(2).run("1")


def test_torchrun_launcher_keeps_names_too():
    world, mark = new_world(2, timeout=120, launcher="torchrun")
    try:
        seen, show = lines_of(world)
        world.run("a = rank + 5")
        r = world.run("print('a is', a)\na", show=show)
        assert dict(r.values) == {0: 5, 1: 6}
        assert sorted((q, t) for q, t, _ in seen) == [(0, "a is 5"), (1, "a is 6")]
        assert world.launcher_used == "torchrun"
    finally:
        stop_and_check(world, mark)
