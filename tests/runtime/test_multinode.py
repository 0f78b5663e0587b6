"""Two nodes on one machine: the README's two `labkit run ... --nnodes 2` commands, run for real.

Node 0 is given the endpoint 127.0.0.1:PORT; node 1 the same endpoint and another loopback
address of its own (`--local-addr 127.0.0.2`), so that the two are told apart as two hosts would
be. Each command is a separate `labkit run` process, as on two machines. Checked: one world of
4 ranks (global ranks by node, local ranks within), a collective across the nodes, each node's
output; a node that comes 10 s late; one that never comes (node 0 says whom it waited for, at
which endpoint); one killed mid-lab (node 0 fails at once, naming the peer); the "localhost"
incident (node 1 given an endpoint that is itself: refused at once instead of a hang); a node 0
that never starts. Nothing may be left running after any of them (the `mark` fixture).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from labkit.runtime import nodes

pytestmark = pytest.mark.multirank

HELLO_LINE = re.compile(r"\[rank (\d)\] rank (\d) of (\d) on .*all_reduce\(rank \+ 1\) = (\d+) "
                        r"\(expected (\d+)\)")
STEPS = "tests/fixtures/labs/allreduce_steps.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(mark, rank, port, *extra, lab="hello", timeout=90, lab_args=(), local=None,
         stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """One node's `labkit run`, as the README gives it (node 1 with --local-addr 127.0.0.2)."""
    cmd = [sys.executable, "-m", "labkit", "run", lab, "-n", "2", "--nnodes", "2",
           "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--timeout", str(timeout), *extra]
    if local or (local is None and rank == 1):
        cmd += ["--local-addr", local or "127.0.0.2"]
    if lab_args:
        cmd += ["--", *lab_args]
    env = {**os.environ, "LABKIT_TEST_MARK": mark}
    return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env,
                            start_new_session=True)


def finish(proc, limit=120):
    out, err = proc.communicate(timeout=limit)
    return proc.returncode, out, err


def hello_ranks(out: str) -> dict[int, int]:
    """global rank -> the all-reduce it printed, from one node's output."""
    found = {}
    for label, rank, world, got, expected in HELLO_LINE.findall(out):
        assert label == rank and world == "4" and got == expected == "10", out
        found[int(rank)] = int(got)
    return found


def check_one_world(outs):
    """Two nodes of 2 ranks: global ranks 0-3 once each, a node's ranks consecutive (torchrun
    gives a node global ranks node_index * 2 + local rank), and the all-reduce across both."""
    per_node = [set(hello_ranks(out)) for out in outs]
    # node 0 (named by the endpoint's address, 127.0.0.1) sorts before 127.0.0.2
    assert per_node == [{0, 1}, {2, 3}], outs


@pytest.mark.parametrize("late", [0, 10])
def test_two_nodes_form_one_world_of_four_ranks(mark, late):
    port = free_port()
    t0 = time.monotonic()
    n0 = node(mark, 0, port)
    time.sleep(late)
    n1 = node(mark, 1, port)
    (rc0, out0, err0), (rc1, out1, err1) = finish(n0), finish(n1)
    wall = time.monotonic() - t0
    assert rc0 == 0 and rc1 == 0, (err0, err1)
    check_one_world([out0, out1])
    assert "finished on 2 rank(s)" in err0 and "finished on 2 rank(s)" in err1
    # a node that starts late is waited for, not failed; and neither waits torchrun's old 30 s
    # to leave: the whole run is the late start plus one launch (about 6 s idle, 10 s loaded)
    assert wall < late + 45, wall


def test_node_that_never_comes_is_named_with_the_endpoint(mark):
    port = free_port()
    rc, out, err = finish(node(mark, 0, port, timeout=8))
    assert rc == 1
    assert "node 0 waited" in err and f"127.0.0.1:{port}" in err, err
    assert "1 of 2 joined" in err and "never came" in err, err


def test_node_killed_mid_lab_fails_the_other_at_once(mark, tmp_path):
    port = free_port()
    args = ("--steps", "200", "--pause", "0.1")
    n0 = node(mark, 0, port, lab=STEPS, lab_args=args)
    # node 1's output goes to files, read as they grow: reading one of its pipes while the
    # other fills up could block it, and this test with it, for good
    out1, err1 = tmp_path / "node1.out", tmp_path / "node1.err"
    with open(out1, "w") as o, open(err1, "w") as e:
        n1 = node(mark, 1, port, lab=STEPS, lab_args=args, stdout=o, stderr=e)
    deadline = time.monotonic() + 60
    while "step 3 of" not in out1.read_text() and time.monotonic() < deadline \
            and n1.poll() is None:                                    # it runs on both nodes
        time.sleep(0.1)
    assert "step 3 of" in out1.read_text(), (out1.read_text(), err1.read_text())
    os.killpg(n1.pid, signal.SIGKILL)       # node 1 dies: its launcher, torchrun, its ranks
    killed = time.monotonic()
    rc, out, err = finish(n0)
    n1.wait(timeout=30)
    assert rc == 1
    assert time.monotonic() - killed < 30            # not the 90 s timeout
    # gloo says "Connection closed by peer" or "Connection reset by peer", by timing
    assert "another node dies" in err and re.search(r"Connection (closed|reset) by peer", err), err


def test_localhost_endpoint_on_node_1_is_refused_at_once(mark):
    """The incident: node 1 given an endpoint that resolves to itself hosted a store of its own
    and waited for a world that never formed. Now: exit 2 at once, the mistake named."""
    port = free_port()
    t0 = time.monotonic()
    rc, out, err = finish(node(mark, 1, port, local=""), limit=30)
    by_name = subprocess.run([sys.executable, "-m", "labkit", "run", "hello", "-n", "2",
                              "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                              f"localhost:{port}"], capture_output=True, text=True, timeout=30)
    assert rc == 2 and by_name.returncode == 2
    assert time.monotonic() - t0 < 20
    for text in (err, by_name.stderr):
        assert "which is this node itself" in text and "--local-addr 127.0.0.2" in text, text


def test_node_1_without_node_0_says_nothing_listens(mark):
    port = free_port()
    rc, out, err = finish(node(mark, 1, port, timeout=6))
    assert rc == 1
    assert "nothing listens there" in err and f"nc -zv 127.0.0.1 {port}" in err, err


# --- the checks themselves, without launching ------------------------------------------------

@pytest.mark.parametrize("bad", ["", "host", "host:", ":29500", "host:0", "host:70000",
                                 "host:port", None])
def test_bad_endpoints_are_refused_with_what_is_allowed(bad):
    with pytest.raises(ValueError, match="HOST:PORT"):
        nodes.parse_endpoint(bad)


def test_endpoints_parse():
    assert nodes.parse_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert nodes.parse_endpoint("[::1]:29500") == ("::1", 29500)
    assert nodes.parse_endpoint(" node0:1 ") == ("node0", 1)


def test_preflight_tells_node_0_when_the_endpoint_is_not_its_own():
    assert nodes.preflight("127.0.0.1:29500", 2, 0) == []
    notes = nodes.preflight("127.0.0.1:29500", 2, 0, local_addr="127.0.0.3")
    assert len(notes) == 1 and "not one of this node's addresses" in notes[0]
    with pytest.raises(ValueError, match="does not resolve"):
        nodes.preflight("no-such-host.invalid:29500", 2, 1)
    # a loopback endpoint is fine for node 1 once it has an address of its own
    assert nodes.preflight("127.0.0.1:29500", 2, 1, local_addr="127.0.0.2") == []
    with pytest.raises(ValueError, match="this node itself"):
        nodes.preflight("127.0.0.2:29500", 2, 1, local_addr="127.0.0.2")


def test_rendezvous_settings_make_node_0_the_only_host():
    host = nodes.rdzv_args(0, 100, None)
    other = nodes.rdzv_args(1, 100, "127.0.0.2")
    assert "is_host=1" in host[1] and "is_host=0" in other[1]
    assert other[-2:] == ["--local-addr", "127.0.0.2"]
    assert f"close_timeout={nodes.CLOSE_TIMEOUT}" in host[1] and "join_timeout=100" in host[1]
