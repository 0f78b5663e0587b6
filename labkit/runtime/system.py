"""Facts about this machine that labs and the doctor share: which backend and how many ranks a
lab uses by default. torch is imported lazily so that importing this module stays cheap."""
from __future__ import annotations

import os
import socket

# On a CPU-only machine, labs default to this many ranks (capped by the cores there are, but
# never below 2: a collective needs two ranks to mean anything, and gloo runs fine oversubscribed).
CPU_DEFAULT_RANKS = 4


def cuda_device_count() -> int:
    """Number of visible CUDA devices (0 when torch has no CUDA build or no GPU is present)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_backend(nproc_per_node: int | None = None) -> str:
    """'nccl' when every local rank can have a GPU of its own, else 'gloo' on CPU.

    LABKIT_BACKEND=gloo|nccl overrides the choice (e.g. to run the CPU path on a GPU node)."""
    forced = os.environ.get("LABKIT_BACKEND")
    if forced:
        if forced not in ("gloo", "nccl"):
            raise ValueError(f"LABKIT_BACKEND={forced!r} is not a backend labkit runs; allowed: gloo, nccl")
        return forced
    gpus = cuda_device_count()
    if gpus == 0:
        return "gloo"
    if nproc_per_node is None or nproc_per_node <= gpus:
        return "nccl"
    return "gloo"


def default_nproc() -> int:
    """Ranks per node a lab starts when not told: one per GPU, else min(4, cores) but at least 2."""
    gpus = cuda_device_count()
    if gpus >= 2:
        return gpus
    return max(2, min(CPU_DEFAULT_RANKS, os.cpu_count() or 1))


# Ranks per core a CPU lab may start before run_lab refuses (oversubscribe=True overrides):
# the course's largest lab, 3D parallelism, runs 8 ranks on a 2-core laptop.
RANKS_PER_CORE = 4
MIN_RANK_LIMIT = 8
BYTES_PER_RANK = 400e6      # a rank with torch imported holds ~300-400 MB (PROBES.md)


def available_memory() -> float | None:
    """Bytes of memory available now (MemAvailable), or None where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def max_local_ranks() -> tuple[int, str]:
    """(the most ranks this machine should run at once, why): RANKS_PER_CORE per core (at least
    MIN_RANK_LIMIT), and no more than the available memory holds at BYTES_PER_RANK each."""
    cores = os.cpu_count() or 1
    limit, why = max(MIN_RANK_LIMIT, RANKS_PER_CORE * cores), f"{cores} cores"
    mem = available_memory()
    if mem is not None and mem // BYTES_PER_RANK < limit:
        limit = max(1, int(mem // BYTES_PER_RANK))
        why = f"{mem / 1e9:.1f} GB of memory available at ~{BYTES_PER_RANK / 1e6:.0f} MB a rank"
    return limit, why


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket process `pid` listens on, from /proc (Linux; [] where
    it cannot be read). Address "0.0.0.0" or "::" means every interface."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "0A" or cols[9] not in inodes:   # 0A = LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            found.append((_proc_address(hex_addr, v6), int(hex_port, 16)))
    return sorted(set(found))


def _proc_address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, words)


def exposed(sockets: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The sockets that listen beyond loopback (every interface, or a non-loopback address)."""
    return [(a, p) for a, p in sockets
            if not (a.startswith("127.") or a in ("::1", "::ffff:127.0.0.1"))]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
