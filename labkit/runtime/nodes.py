"""Several nodes: check the rendezvous before torchrun waits on it, and say what went wrong.

    notes = preflight("10.0.0.1:29500", nnodes=2, node_rank=1, local_addr=None)  # or ValueError
    rdzv_args(node_rank=1, join_timeout=600, local_addr=None)     # torchrun's --rdzv-conf ...
    joined("10.0.0.1", 29500, "labkit-hello")                     # who reached the rendezvous
    SimulatedNode("hello", 2, nnodes=2, node_rank=1, endpoint="127.0.0.1:29500")  # on loopback

torchrun's c10d rendezvous lets any node whose endpoint names itself (any loopback name does)
host a store of its own: a node given "localhost" then forms a world of its own, and every node
waits for the others until the join timeout (600 s). Here node 0 hosts, a node given itself
is refused at once, and a stuck rendezvous is reported with its endpoint: docs/runtime.md.
"""
from __future__ import annotations

import ipaddress
import socket


MAX_PORT = 65_535
# torchrun's rendezvous waits this long for its last store operations when a node leaves
# (torch's default close_timeout is 30 s): a node that finishes after the store's host has
# gone then waited 30 s for nothing (measured: a 2-rank hello across 2 loopback nodes took
# 31-33 s at load 8, 0.2 s on one node).
CLOSE_TIMEOUT = 3
NULL_STATE = b"Y2FuaW1hZGFt"     # C10dRendezvousBackend._NULL_SENTINEL


def parse_endpoint(endpoint) -> tuple[str, int]:
    """("10.0.0.1", 29500) from "10.0.0.1:29500" ("[::1]:29500" for IPv6); ValueError saying
    what is allowed otherwise."""
    text = str(endpoint).strip() if endpoint is not None else ""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
        raise ValueError(f"rdzv_endpoint={endpoint!r} is not HOST:PORT; allowed: a host name or "
                         f"address of node 0 and a port 1 to {MAX_PORT}, e.g. 10.0.0.1:29500 "
                         "(the same on every node)")
    return host, int(port)


def addresses(host: str) -> set[str]:
    """Every IP address `host` resolves to (empty if it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {info[4][0].split("%")[0] for info in infos}


def own_addresses(local_addr: str | None = None) -> set[str]:
    """This node's addresses: local_addr's when given (a node simulated on a loopback address
    of its own), else every interface's, the host name's, and loopback."""
    if local_addr:
        return addresses(local_addr) or {local_addr}
    found = addresses(socket.gethostname()) | addresses(socket.getfqdn())
    try:
        import psutil
        found |= {a.address.split("%")[0] for nics in psutil.net_if_addrs().values()
                  for a in nics if a.family in (socket.AF_INET, socket.AF_INET6)}
    except ImportError:                 # psutil comes with the course; the rest still counts
        pass
    return found | {"127.0.0.1", "::1"}


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def is_self(host: str, local_addr: str | None = None) -> bool:
    """Whether `host` names this node. Without local_addr, every loopback address does."""
    resolved = addresses(host)
    if not resolved:
        return False
    own = own_addresses(local_addr)
    if local_addr is None and any(_loopback(a) for a in resolved):
        return True
    return bool(resolved & own)


def preflight(endpoint, nnodes: int, node_rank: int | None,
              local_addr: str | None = None) -> list[str]:
    """Refuse a node's rendezvous settings that cannot work (ValueError naming the mistake);
    return notes worth printing for those that may."""
    host, port = parse_endpoint(endpoint)
    if local_addr is not None and not addresses(local_addr):
        raise ValueError(f"local_addr={local_addr!r} does not resolve to an address; allowed: "
                         "an address or name of this node (127.0.0.2 to simulate a node)")
    if not addresses(host):
        raise ValueError(f"rdzv_endpoint {host}:{port}: the host {host!r} does not resolve "
                         "on this node; allowed: node 0's address or a name this node resolves")
    if node_rank is None or nnodes == 1:
        return []
    me = local_addr or socket.gethostname()
    if node_rank > 0 and is_self(host, local_addr):
        raise ValueError(
            f"node {node_rank} was given the rendezvous endpoint {host}:{port}, which is this "
            f"node itself ({me}): node 0 hosts the rendezvous, so every other node must be given "
            f"node 0's address (e.g. --rdzv-endpoint NODE0_ADDRESS:{port}). Given its own "
            "address, a node forms a world of its own and waits for the others until the "
            "timeout. To simulate several nodes on one machine, give each its own loopback "
            "address: --local-addr 127.0.0.2 on node 1, and 127.0.0.1 as the endpoint")
    if node_rank == 0 and not is_self(host, local_addr):
        return [f"node 0 hosts the rendezvous on port {port}, but {host} is not one of this "
                f"node's addresses ({me}); fine if it is a public or NAT address of this node, "
                "otherwise the other nodes will wait at the wrong host"]
    return []


def host_address(endpoint) -> str | None:
    """Node 0's own address for torchrun (--local-addr): the endpoint's host when it is an IP
    address of this node, else None (torchrun then uses the host's FQDN).

    Why: c10d numbers the nodes by their sorted addresses, not by --node-rank. Node 0 named by
    the address the others reach it at sorts before host names (and before 127.0.0.2 on one
    machine), so it usually holds global ranks 0 to nproc - 1, as the course's labs assume."""
    host, _ = parse_endpoint(endpoint)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host if is_self(host) else None


def rdzv_args(node_rank: int | None, join_timeout: float | None,
              local_addr: str | None) -> list[str]:
    """torchrun's options for the c10d rendezvous: node 0 hosts the store and the others never
    do (so a node that mistakes itself for the host cannot form a world of its own); a node
    waits for the others as long as the lab's timeout; leaving takes at most CLOSE_TIMEOUT."""
    conf = [f"close_timeout={CLOSE_TIMEOUT}"]
    if join_timeout is not None:       # a node started before node 0 keeps trying its port
        conf += [f"join_timeout={max(1, int(join_timeout))}",
                 f"read_timeout={max(1, int(join_timeout))}"]
    if node_rank is not None:
        conf.append(f"is_host={'1' if node_rank == 0 else '0'}")
    args = ["--rdzv-conf", ",".join(conf)]
    return args + (["--local-addr", local_addr] if local_addr else [])


def listening(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def nobody_listens(host: str, port: int, node_rank: int | None, waited: float) -> str:
    """The message for a node whose rendezvous endpoint never answered."""
    return (f"node {node_rank} waited {waited:.0f} s for the rendezvous at {host}:{port} and "
            "nothing listens there: node 0 has not started (start it with the same "
            "--rdzv-endpoint), the address is not node 0's, or the port is closed between the "
            f"nodes (check from this node: nc -zv {host} {port})")


def notice_if_waiting(host: str, port: int, node_rank: int | None, after: float, say):
    """A timer that tells, once, that node 0's port is not open yet `after` seconds from now
    (torchrun keeps trying it meanwhile); cancel() it when the ranks start."""
    import threading

    def check():
        if not listening(host, port):
            say(f"node {node_rank}: waiting for node 0's rendezvous at {host}:{port} ...")
    timer = threading.Timer(after, check)
    timer.daemon = True
    timer.start()
    return timer


def joined(host: str, port: int, run_id: str, timeout: float = 2.0) -> list[str] | None:
    """The nodes (their addresses) that have joined rendezvous `run_id` at host:port so far,
    read from the c10d store (None when it cannot be read)."""
    import base64
    import pickle
    from datetime import timedelta

    try:
        from torch.distributed import TCPStore
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        key = "torch.rendezvous." + run_id
        if not store.check([key]):
            return []
        raw = store.get(key)
        if raw == NULL_STATE:           # torch's "no state yet"
            return []
        state = pickle.loads(base64.b64decode(raw))    # what dynamic_rendezvous wrote
    except Exception:                   # a diagnosis only: never fail the report over it
        return None
    nodes = set(getattr(state, "participants", {})) | set(getattr(state, "wait_list", set()))
    return sorted(n.addr for n in nodes)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a rendezvous endpoint on one machine)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SimulatedNode:
    """Another node on this machine: `labkit run LAB --nnodes N --node-rank R` in a process of
    its own, with a loopback address of its own, as a second machine would run it. It dies with
    this process (labkit.runtime.guard), and its output is kept in files (a pipe that nobody
    reads would fill and stall it).

        other = SimulatedNode("hello", 2, nnodes=2, node_rank=1, endpoint="127.0.0.1:29400")
        result = run_lab("hello", 2, nnodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:29400")
        code, out, err = other.finish()
    """

    def __init__(self, lab: str, nproc: int, *, nnodes: int, node_rank: int, endpoint: str,
                 local_addr: str | None = None, rdzv_id: str | None = None, timeout: float = 120,
                 args=(), env: dict | None = None):
        import os
        import subprocess
        import sys
        import tempfile

        from labkit.runtime import guard

        parse_endpoint(endpoint)
        local_addr = f"127.0.0.{node_rank + 1}" if local_addr is None else local_addr
        cmd = [sys.executable, "-m", "labkit", "run", str(lab), "-n", str(nproc),
               "--nnodes", str(nnodes), "--node-rank", str(node_rank),
               "--rdzv-endpoint", endpoint, "--timeout", str(timeout)]
        cmd += ["--local-addr", local_addr] if local_addr else []
        cmd += ["--rdzv-id", rdzv_id] if rdzv_id else []
        cmd += ["--", *map(str, args)] if args else []
        self.dir = tempfile.mkdtemp(prefix="labkit-node-")
        self._out = open(os.path.join(self.dir, "stdout"), "w+", encoding="utf-8")
        self._err = open(os.path.join(self.dir, "stderr"), "w+", encoding="utf-8")
        self.proc = subprocess.Popen(guard.guarded_command(cmd), stdout=self._out,
                                     stderr=self._err, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        """Wait for the node (stopping it after `timeout` s); (exit code, stdout, stderr)."""
        import subprocess
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
        return self.proc.returncode, *self._read()

    def stop(self) -> None:
        """SIGKILL the node: its launcher, torchrun and ranks (its process group and guard)."""
        import os
        import signal
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def _read(self) -> tuple[str, str]:
        import shutil
        texts = []
        for f in (self._out, self._err):
            f.flush()
            f.seek(0)
            texts.append(f.read())
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return texts[0], texts[1]
