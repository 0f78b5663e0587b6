"""The send/recv exercises of module 02 as their checks see them: a function defined in a cell
reaches the ranks as source (labkit.labs.ring), runs on 4 gloo ranks next to torch's collective,
and the bytes each rank sent are measured (wchar) against the ring's 2(N-1)/N S."""
from __future__ import annotations

import linecache

import pytest
import torch
import torch.distributed as dist

from labkit.comm import bytes_sent_per_rank
from labkit.labs import ring
from labkit.labs.common import exercise as shared

N = 4


def ring_all_reduce(tensor):
    """Reference: reduce-scatter then all-gather around the ring, with isend/irecv."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(tensor.view(-1).tensor_split(n))
    recv = torch.empty_like(chunks[0])
    for s in range(n - 1):
        send_c, recv_c = (rank - s) % n, (rank - s - 1) % n
        buf = recv[: chunks[recv_c].numel()]
        reqs = [dist.isend(chunks[send_c], right), dist.irecv(buf, left)]
        for r in reqs:
            r.wait()
        chunks[recv_c] += buf
    for s in range(n - 1):
        send_c, recv_c = (rank + 1 - s) % n, (rank - s) % n
        reqs = [dist.isend(chunks[send_c], right), dist.irecv(chunks[recv_c], left)]
        for r in reqs:
            r.wait()
    return tensor


def reduce_scatter_only(tensor):
    """A classic mistake: the reduce-scatter phase without the all-gather."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(tensor.view(-1).tensor_split(n))
    for s in range(n - 1):
        send_c, recv_c = (rank - s) % n, (rank - s - 1) % n
        buf = torch.empty_like(chunks[recv_c])
        reqs = [dist.isend(chunks[send_c], right), dist.irecv(buf, left)]
        for r in reqs:
            r.wait()
        chunks[recv_c] += buf
    return tensor


def ring_all_gather(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    out = torch.empty((n, *tensor.shape), dtype=tensor.dtype)
    out[rank] = tensor
    for s in range(n - 1):
        send_c, recv_c = (rank - s) % n, (rank - s - 1) % n
        reqs = [dist.isend(out[send_c], right), dist.irecv(out[recv_c], left)]
        for r in reqs:
            r.wait()
    return out.view(n * tensor.shape[0], *tensor.shape[1:])


def stub(tensor):
    raise NotImplementedError("write ring_all_reduce (about 20 lines)")


def calls_all_reduce(tensor):
    """Issue 10: passed 4/4 before, since gloo's all_reduce sends the ring's bytes too."""
    dist.all_reduce(tensor)
    return tensor


def calls_the_process_group(tensor):
    dist.group.WORLD.allreduce([tensor]).wait()
    return tensor


# ---------------------------------------------------------------------------------------------
# how the function reaches the ranks (no launch)

def test_cell_source_keeps_definitions_and_drops_calls():
    cell = ("import torch\nimport torch.distributed as dist\nCHUNKS = 4\n"
            "results = launch_everything()\nprint('hello')\n"
            "def helper(x):\n    return x * CHUNKS  # a comment stays\n\n"
            "def my_collective(tensor):\n    return helper(tensor)\n"
            "for i in range(3):\n    pass\n")
    filename = "/tmp/ipykernel_0/fake_cell.py"        # what ipykernel names a cell
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    ns = {"launch_everything": lambda: None}
    exec(compile(cell, filename, "exec"), ns)
    src = shared.function_source(ns["my_collective"])
    assert "launch_everything" not in src and "print(" not in src and "for i" not in src
    for kept in ("import torch.distributed as dist", "CHUNKS = 4", "def helper(x):",
                 "# a comment stays", "def my_collective(tensor):"):
        assert kept in src
    ns2: dict = {}
    exec(compile(src, "<exported>", "exec"), ns2)     # the exported file runs on its own
    assert ns2["my_collective"](torch.ones(2)).tolist() == [4.0, 4.0]


def test_nested_function_is_refused():
    def inner(tensor):
        return tensor
    with pytest.raises(ValueError, match="top level"):
        shared.function_source(inner)


def test_stub_fails_fast_without_ranks():
    with pytest.raises(NotImplementedError, match="not written yet"):
        ring.run_user_collective(stub, op="all_reduce", nproc=N)
    with pytest.raises(ValueError, match="nproc"):
        ring.run_user_collective(ring_all_reduce, nproc=1)
    with pytest.raises(ValueError, match="allowed"):
        ring.run_user_collective(ring_all_reduce, op="broadcast")


def test_collectives_are_refused_inside_and_restored_after():
    before = (dist.all_reduce, vars(dist.ProcessGroup)["allreduce"])
    refusals: list = []
    with shared.point_to_point_only("my_ring", refusals):
        with pytest.raises(shared.Refused, match="your my_ring calls torch.distributed.all_reduce; "
                                                "write it yourself with dist.isend/dist.irecv"):
            dist.all_reduce(torch.ones(2))
        with pytest.raises(shared.Refused, match="ProcessGroup.allreduce"):
            dist.ProcessGroup.allreduce(None, [torch.ones(2)])
        assert dist.isend.__module__ == "torch.distributed.distributed_c10d"   # p2p untouched
    assert len(refusals) == 2
    assert (dist.all_reduce, vars(dist.ProcessGroup)["allreduce"]) == before


@pytest.mark.multirank
@pytest.mark.parametrize("cheat, called", [(calls_all_reduce, "torch.distributed.all_reduce"),
                                           (calls_the_process_group, "ProcessGroup.allreduce")])
def test_a_ring_that_calls_a_collective_is_refused(cheat, called):
    r = ring.run_user_collective(cheat, op="all_reduce", nproc=2, nbytes=2**20, iters=1)
    assert not r.ok
    assert r.refused == (f"your {cheat.__name__} calls {called}; write it yourself with "
                         "dist.isend/dist.irecv (only point-to-point messages)")
    assert f"REFUSED: {r.refused}" in r.summary()


# ---------------------------------------------------------------------------------------------
# on 4 ranks

@pytest.mark.multirank
def test_ring_all_reduce_matches_gloo_and_sends_the_ring_bytes():
    r = ring.run_user_collective(ring_all_reduce, op="all_reduce", nproc=N,
                                 nbytes=2 * 2**20, iters=2)
    assert r.ok, r.summary()
    assert r.expected_sent == bytes_sent_per_rank("all_reduce", r.nbytes, N) == 1.5 * r.nbytes
    for sent, sent_torch in zip(r.sent, r.sent_torch):
        assert sent == pytest.approx(r.expected_sent, rel=0.01)
        assert sent_torch == pytest.approx(r.expected_sent, rel=0.01)   # gloo's own ring
    assert r.time_user > 0 and r.time_torch > 0 and r.time_ratio > 0
    assert "ratio" in r.summary()


@pytest.mark.multirank
def test_a_wrong_ring_is_caught_with_a_reason():
    r = ring.run_user_collective(reduce_scatter_only, op="all_reduce", nproc=N,
                                 nbytes=2**20, iters=1)
    assert not r.ok
    assert any("differ from torch's all_reduce" in p for p in r.problems)
    assert r.sent[0] == pytest.approx(r.expected_sent / 2, rel=0.01)   # half the ring's bytes


def test_ring_all_gather_source_exports():
    """(Its 4-rank run is in solutions/02_collectives.ipynb, executed by the notebook tier.)"""
    src = shared.function_source(ring_all_gather)
    assert "def ring_all_gather(tensor):" in src and "import torch.distributed as dist" in src
