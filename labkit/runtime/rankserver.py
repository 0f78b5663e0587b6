"""What each rank of a `%ranks` world runs (labkit.runtime.world starts it, under bootstrap).

It sets up the process group, connects to the kernel's socket (LABKIT_RANKS_SOCKET) and runs the
cells it is sent in one namespace that lives as long as the rank: names a cell defines stay for
the next. Each cell's reply carries the value of its last expression (pickled, or why not), its
exception with the traceback (the rank stays usable), the collectives it issued
(labkit.runtime.measure.CollectiveCounter) and its peak memory. Messages on the socket are
length-prefixed pickles (`send`, `Frames`).
"""
from __future__ import annotations

import ast
import linecache
import os
import pickle
import re
import signal
import socket
import struct
import sys
import time
import traceback

ENV_SOCKET = "LABKIT_RANKS_SOCKET"
ENV_DEVICE = "LABKIT_RANKS_DEVICE"
MAX_VALUE_BYTES = 64 * 2**20     # a value bigger than this is refused (say what to return)
_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


class Frames:
    """Reassembles the messages of a byte stream (`send`'s frames), fed as they arrive."""

    def __init__(self):
        self.buf = b""

    def feed(self, chunk: bytes) -> list:
        self.buf += chunk
        out = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + n:
                break
            out.append(pickle.loads(self.buf[_HEADER.size:_HEADER.size + n]))
            self.buf = self.buf[_HEADER.size + n:]
        return out


def cell_filename(cell: int) -> str:
    return f"%%ranks cell {cell}"


# ---------------------------------------------------------------------------------------------
# memory

def _status_kib(field: str, pid: str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident memory of a process (Linux /proc; None elsewhere)."""
    return _status_kib("VmRSS", str(pid))


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (Linux: clear_refs 5 resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# one cell

def _split(code: str, filename: str):
    """(statements, last expression or None), as IPython runs a cell: the last statement's
    value is the cell's value unless the cell ends with ';'."""
    tree = ast.parse(code, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    return tree, last


def _error(exc: BaseException) -> dict:
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not f.filename.endswith(os.path.join("runtime", "rankserver.py"))])
    return {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(te.format())}


def _portable(value):
    """A value as it can leave the rank: tensors detached and on the CPU; DTensors refused."""
    import torch
    if type(value).__name__ == "DTensor":
        raise TypeError("a DTensor keeps its device mesh and process group, which cannot leave "
                        "its rank: end the cell with dt.to_local() (this rank's shard), "
                        "dt.placements, or dt.full_tensor() (the whole tensor, gathered on every "
                        "rank)")
    if isinstance(value, torch.Tensor):
        # a collective's result may still be in flight (an AsyncCollectiveTensor, e.g. the
        # output of a parallelize_module'd layer): wait for it, or half of it is sent
        wait = getattr(value, "trigger_wait", None)
        return (wait() if callable(wait) else value).detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_portable(v) for v in value)
    if type(value) is dict:
        return {k: _portable(v) for k, v in value.items()}
    return value


def _pack(value) -> tuple[bytes | None, str | None]:
    """(pickled value, None) or (None, why it cannot be sent)."""
    what = type(value).__name__
    try:
        value = _portable(value)
    except TypeError as exc:
        return None, str(exc)
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return None, (f"the value of the last expression (a {what}) cannot be sent to the "
                      f"notebook ({type(exc).__name__}: {exc}); allowed: values pickle can "
                      "carry (numbers, strings, lists, dicts, tensors): return e.g. t.tolist(), "
                      "t.shape, or a tensor")
    if len(data) > MAX_VALUE_BYTES:
        return None, (f"the value of the last expression (a {what}) is {len(data) / 2**20:.0f} "
                      f"MiB pickled; allowed: up to {MAX_VALUE_BYTES // 2**20} MiB: return a "
                      "summary (t.shape, t[:4], t.sum())")
    return data, None


def run_cell(code: str, cell: int, ns: dict, count: bool = True) -> dict:
    """Run one cell in `ns`; the reply for the kernel."""
    from labkit.runtime import measure
    import torch
    filename = cell_filename(cell)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    reset = _reset_peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss0 = rss_bytes()
    counter = measure.CollectiveCounter()
    reply = {"op": "done", "cell": cell, "error": None, "value": None, "has_value": False,
             "value_error": None, "interrupted": False}
    t0 = time.perf_counter()
    try:
        tree, last = _split(code, filename)
        with (counter if count else _Nothing()):
            exec(compile(tree, filename, "exec"), ns)
            if last is not None:
                value = eval(compile(last, filename, "eval"), ns)
                if value is not None:
                    ns["_"] = value
                    reply["has_value"] = True
                    reply["value"], reply["value_error"] = _pack(value)
    except KeyboardInterrupt as exc:
        reply["interrupted"] = True
        reply["error"] = _error(exc)
    except BaseException as exc:         # SystemExit too: the rank stays
        reply["error"] = _error(exc)
    reply["wall"] = time.perf_counter() - t0
    sys.stdout.flush()
    sys.stderr.flush()
    reply["collectives"] = counter.by_kind if count else None
    reply["rss_start"] = rss0
    reply["peak_rss"] = _status_kib("VmHWM") if reset else None
    reply["rss"] = rss_bytes()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        reply["cuda_peak"] = torch.cuda.max_memory_allocated()
    return reply


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# the rank's loop

def _warm_up() -> None:
    """The collective counter's first use imports torch._dynamo (about 1-2 s): pay it now,
    while the learner reads, not in the first cell (a cell sent meanwhile waits in the socket)."""
    from labkit.runtime import measure
    import torch
    try:
        with measure.CollectiveCounter():
            torch.zeros(1).add_(1)
    except KeyboardInterrupt:
        pass


def namespace(ctx) -> dict:
    """What every cell starts with (as %%torchrun cells): rank, world_size, device, ctx, torch,
    dist (torch.distributed), report, print0."""
    import torch
    import torch.distributed
    from labkit.runtime import dist
    return {"__name__": "__ranks__", "__builtins__": __builtins__, "torch": torch,
            "dist": torch.distributed, "ctx": ctx, "rank": ctx.rank,
            "world_size": ctx.world_size, "device": ctx.device, "report": dist.report,
            "print0": dist.print0}


def main() -> None:
    from labkit.runtime import dist
    device = os.environ.get(ENV_DEVICE) or None
    ctx = dist.setup(device=device)
    ns = namespace(ctx)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ[ENV_SOCKET])
    send(sock, {"op": "hello", "rank": ctx.rank, "pid": os.getpid(), "backend": ctx.backend,
                "device": str(ctx.device)})
    frames = Frames()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _warm_up()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except KeyboardInterrupt:          # an interrupt that came after its cell ended
            continue
        if not chunk:
            break
        stop = False
        for msg in frames.feed(chunk):
            if msg["op"] == "run":
                try:
                    reply = run_cell(msg["code"], msg["cell"], ns, msg.get("count", True))
                except KeyboardInterrupt:  # came while the reply was being made
                    reply = {"op": "done", "cell": msg["cell"], "interrupted": True,
                             "error": {"type": "KeyboardInterrupt", "message": "",
                                       "traceback": "KeyboardInterrupt\n"}}
                send(sock, reply)
            elif msg["op"] == "stop":
                stop = True
        if stop:
            break
    sys.stdout.flush()
    dist.shutdown(exit_process=True, wait=False)
    os._exit(0)


if __name__ == "__main__":
    main()
