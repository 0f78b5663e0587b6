"""Your collective, written with send/recv, on real ranks next to torch's own: checks the result,
counts the bytes each rank sent, and times both in the same run.

    torchrun --nproc-per-node 4 -m labkit.labs.ring --source my_ring.py --func ring_all_reduce
    torchrun --nproc-per-node 4 -m labkit.labs.ring --source my_ring.py --func ring_all_gather \
        --op all_gather --bytes 4M --iters 5

From a notebook (module 02's exercises; the contract and the checks: `run_user_collective`):
    from labkit.labs.ring import run_user_collective
    r = run_user_collective(ring_all_reduce, op="all_reduce", nproc=4)
    r.ok, r.sent, r.expected_sent, r.time_ratio
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from labkit.labs.common.exercise import (Refused, export_function, load_source, note_refusal,
                                         point_to_point_only, rank_guard, remember_refusal)

OPS = ("all_reduce", "all_gather")
DEFAULT_BYTES = 4 * 2**20
DEFAULT_TIMEOUT = 45      # seconds: the deadlock bound (a correct run takes ~6 s on 2 cores)

# ---------------------------------------------------------------------------------------------
# from the notebook: the function's source to a file


@dataclass
class CollectiveCheck:
    """What run_user_collective found, per rank (lists indexed by rank) and overall."""

    op: str
    world_size: int
    nbytes: int                      # S, as nccl-tests: the all_reduce buffer / gathered output
    small_ok: list                   # exact match on the small input
    large_ok: list                   # exact match on the large input
    max_error: list                  # largest |yours - torch's| on the large input
    problems: list                   # per rank: a sentence on what was wrong, or ""
    sent: list                       # bytes each rank sent in one call of yours (gloo: wchar)
    sent_torch: list                 # ... in one call of torch's collective
    expected_sent: float             # the ring's figure: labkit.comm.bytes_sent_per_rank
    time_user: float                 # seconds per call, mean over iterations, max over ranks
    time_torch: float
    output: list = field(default_factory=list, repr=False)
    refused: str = ""                # why the function was refused (it called a collective)

    @property
    def ok(self) -> bool:
        return not self.refused and all(self.small_ok) and all(self.large_ok)

    @property
    def sent_ratio(self) -> list:
        """Bytes each rank sent / the ring's figure (None where not measurable)."""
        return [None if s is None else s / self.expected_sent for s in self.sent]

    @property
    def time_ratio(self) -> float:
        """Your collective's time / torch's, measured in the same run."""
        return self.time_user / self.time_torch

    def summary(self) -> str:
        lines = [f"{self.op} on {self.world_size} ranks, S = {self.nbytes:,} B "
                 f"({self.nbytes / 1e6:.2f} MB, {self.nbytes / 2**20:.2f} MiB):"]
        if self.refused:
            lines.append(f"  REFUSED: {self.refused}")
        for r in range(self.world_size):
            sent = "n/a" if self.sent[r] is None else (
                f"{self.sent[r]:,.0f} B ({self.sent[r] / self.expected_sent:.4f} x ring figure)")
            lines.append(f"  rank {r}: {'correct' if self.small_ok[r] and self.large_ok[r] else 'WRONG'}"
                         f", sent {sent}" + (f"  <- {self.problems[r]}" if self.problems[r] not in ("", self.refused) else ""))
        lines.append(f"  ring figure per rank: {self.expected_sent:,.0f} B")
        lines.append(f"  time per call: yours {self.time_user * 1e3:.2f} ms, torch's "
                     f"{self.time_torch * 1e3:.2f} ms, ratio {self.time_ratio:.2f}")
        return "\n".join(lines)


def _stub_message(fn):
    """Call fn once in this process (no process group): a stub raises NotImplementedError at
    once, and then there is no point starting ranks."""
    import torch
    try:
        fn(torch.zeros(8))
    except NotImplementedError as exc:
        return f"{fn.__name__}() is not written yet (it raised NotImplementedError: {exc})"
    except Exception:
        return None      # expected: it needs a process group
    return None


def run_user_collective(fn, op: str = "all_reduce", nproc: int = 4,
                        nbytes: int = DEFAULT_BYTES, iters: int = 3,
                        timeout: float = DEFAULT_TIMEOUT,
                        quiet: bool = True) -> CollectiveCheck:
    """Run `fn` (defined in a notebook cell or a module) on `nproc` ranks as the `op` it
    implements, against torch's collective. Raises ValueError for a stub or a function whose
    source cannot be found, and labkit.runtime.launch.LabError (naming the rank and its
    exception) when a rank fails or the run passes `timeout` seconds.

    The function reaches the ranks as source: the notebook cell (or module) that defined it is
    written to a temporary file, keeping only its imports, definitions and constant assignments
    (so a call or a launch in the same cell does not run again on every rank), and each rank
    imports it. Anything the function uses must therefore be defined or imported in that same
    cell.

    Contract of the functions checked:
    - all_reduce: `fn(tensor)` sums `tensor` over all ranks *in place* (like dist.all_reduce).
    - all_gather: `fn(tensor)` returns a new tensor, the inputs of ranks 0..N-1 concatenated
      (dim 0).
    Each rank checks two inputs with exact small-integer values (so the order of additions does
    not matter): a small one (3N elements) and one of `--bytes` (default 4 MiB); the bytes it
    sends in the large call (the `wchar` delta of /proc/self/io: every byte gloo writes to its
    sockets) are compared with the ring's figure, `labkit.comm.bytes_sent_per_rank`.

    Only point-to-point messages are allowed: while the function runs, torch.distributed's
    collectives (and the process group's own) raise, and the check reports `refused` ("your
    ring_all_reduce calls torch.distributed.all_reduce; write it yourself ..."): an all-reduce
    that calls dist.all_reduce sends the right bytes too. A lab that hangs (the classic deadlock
    of blocking sends) is stopped after `timeout` s (45 by default; a correct run takes ~6 s on
    2 cores)."""
    from labkit.runtime.launch import LabError, run_lab
    from labkit.validate import choice, positive_int

    choice("op", op, OPS)
    nproc = positive_int("nproc", nproc)
    if nproc < 2:
        raise ValueError(f"nproc={nproc} must be >= 2: a collective needs two ranks")
    stub = _stub_message(fn)
    if stub:
        raise NotImplementedError(stub)
    env, exercise = rank_guard(fn)      # while grading: what the exercise may not call
    with tempfile.TemporaryDirectory(prefix="labkit-user-") as tmp:
        path = export_function(fn, tmp)
        try:
            res = run_lab("labkit.labs.ring", nproc=nproc, timeout=timeout, quiet=quiet, env=env,
                          args=["--source", path, "--func", fn.__name__, "--op", op,
                                "--bytes", str(nbytes), "--iters", str(iters)])
            remember_refusal(res, exercise)
        except LabError as exc:
            if exc.reason == "timeout":
                raise LabError(
                    f"{fn.__name__}() did not finish within {timeout:.0f} s on {nproc} ranks. A "
                    "usual cause: every rank calls a blocking dist.send first, and each waits "
                    "for a receiver that is itself blocked sending. Post the receive and the "
                    "send together (dist.irecv + dist.isend, then .wait() both), or order them "
                    "by rank parity.\n\n" + str(exc), reason=exc.reason, rank=exc.rank,
                    exc_type=exc.exc_type, exc_message=exc.exc_message,
                    traceback=exc.traceback, result=exc.result) from None
            raise
    rs = res.results
    per = lambda key: [rs[r].get(key) for r in range(nproc)]  # noqa: E731
    return CollectiveCheck(
        op=op, world_size=nproc, nbytes=rs[0]["nbytes"], small_ok=per("small_ok"),
        large_ok=per("large_ok"), max_error=per("max_error"), problems=per("problem"),
        sent=per("sent"), sent_torch=per("sent_torch"), expected_sent=rs[0]["expected_sent"],
        time_user=max(per("time_user")), time_torch=max(per("time_torch")), output=res.output,
        refused=next((r for r in per("refused") if r), ""))


# ---------------------------------------------------------------------------------------------
# inside a rank


def _inputs(op, numel, rank, world_size):
    """Small exact integers: sums are exact in float32 whatever the order of additions."""
    import torch
    g = torch.Generator().manual_seed(1234 + 7 * rank + numel)
    per_rank = numel // world_size if op == "all_gather" else numel
    return torch.randint(-8, 8, (per_rank,), generator=g).float()



def _call(fn, op, x, refusals: list, func: str):
    """(result, problem): run fn as `op` on a copy of x, collectives refused."""
    import torch
    y = x.clone()
    try:
        with point_to_point_only(func, refusals):
            ret = fn(y)
    except Refused:
        return None, refusals[0]
    except Exception as exc:     # the grader's rank guard (labkit.course.forbid, not imported)
        if type(exc).__name__ != "ForbiddenCall":
            raise
        refusals.append(str(exc))
        return None, str(exc)
    if refusals:
        return None, refusals[0]
    if op == "all_reduce":
        return y, ("" if ret is None or ret is y or not isinstance(ret, torch.Tensor)
                   or torch.equal(ret, y) else
                   "returned a tensor different from the one it was given: the sum must be "
                   "written into `tensor` in place")
    if not isinstance(ret, torch.Tensor):
        return None, f"returned {type(ret).__name__}, not the gathered tensor"
    return ret, ""


def _reference(op, x, world_size):
    import torch
    import torch.distributed as tdist
    if op == "all_reduce":
        y = x.clone()
        tdist.all_reduce(y)
        return y
    out = torch.empty(x.numel() * world_size, dtype=x.dtype)
    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    fn(out, x)
    return out


def _compare(op, got, want, rank, size_name) -> tuple[bool, float, str]:
    import torch
    if got is None:
        return False, float("inf"), ""
    if got.shape != want.shape:
        return False, float("inf"), (f"{size_name} input: result has shape {tuple(got.shape)}, "
                                     f"torch's has {tuple(want.shape)}")
    if torch.equal(got, want):
        return True, 0.0, ""
    bad = (got != want).nonzero().flatten()
    i = int(bad[0])
    err = float((got - want).abs().max())
    return False, err, (f"{size_name} input: {bad.numel()} of {want.numel()} elements differ "
                        f"from torch's {op}; first at index {i}: {got[i].item():g} vs "
                        f"{want[i].item():g}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="check a send/recv collective against torch's")
    p.add_argument("--source", required=True, help="a .py file defining the function")
    p.add_argument("--func", required=True, help="the function's name")
    p.add_argument("--op", default="all_reduce", choices=OPS)
    p.add_argument("--bytes", default=str(DEFAULT_BYTES),
                   help="S of the large check (default 4M; >= 1M so headers are < 1%%)")
    p.add_argument("--iters", type=int, default=3, help="timed calls of each (default 3)")
    args = p.parse_args(argv)

    import torch.distributed as tdist
    from labkit.runtime import dist
    from labkit.comm import bytes_sent_per_rank
    from labkit.labs.common.wire import bytes_written
    from labkit.labs.common.flags import parse_size

    ctx = dist.setup(backend="gloo")     # the byte count reads this process's socket writes
    n, rank = ctx.world_size, ctx.rank
    fn = load_source(args.source, args.func)
    elem = 4
    numel = max(1, parse_size(args.bytes) // (elem * n)) * n
    nbytes = numel * elem

    refusals: list = []
    # 1) a small input
    x = _inputs(args.op, 3 * n, rank, n)
    got, problem = _call(fn, args.op, x, refusals, args.func)
    small_ok, _, why = _compare(args.op, got, _reference(args.op, x, n), rank, "small")
    problem = problem or why
    # 2) the large input, counting the bytes written to sockets during the call
    x = _inputs(args.op, numel, rank, n)
    want = _reference(args.op, x, n)
    tdist.barrier()
    w0 = bytes_written()
    got, why = _call(fn, args.op, x, refusals, args.func)
    w1 = bytes_written()
    tdist.barrier()
    sent = None if w0 is None else w1 - w0
    large_ok, err, why2 = _compare(args.op, got, want, rank, "large")
    problem = problem or why or why2
    y = x.clone()
    tdist.barrier()
    w0 = bytes_written()
    _reference(args.op, y, n)
    w1 = bytes_written()
    sent_torch = None if w0 is None else w1 - w0
    # 3) time both, alternating, in the same run
    t_user = t_torch = 0.0
    for _ in range(args.iters):
        tdist.barrier()
        t0 = time.perf_counter()
        if not refusals:
            with point_to_point_only(args.func, refusals):
                fn(x) if args.op == "all_gather" else fn(y)      # all_reduce: in place, on y
        t_user += time.perf_counter() - t0
        tdist.barrier()
        t0 = time.perf_counter()
        _reference(args.op, x, n) if args.op == "all_gather" else tdist.all_reduce(y)
        t_torch += time.perf_counter() - t0
    out = dict(nbytes=nbytes, small_ok=small_ok, large_ok=large_ok, max_error=err,
               problem=problem, sent=sent, sent_torch=sent_torch,
               refused=refusals[0] if refusals else "",
               expected_sent=bytes_sent_per_rank(args.op, nbytes, n),
               time_user=t_user / args.iters, time_torch=t_torch / args.iters)
    note_refusal(out)                   # the rank guard's (labkit.course.forbid), if any
    if out.get("forbidden"):
        out["small_ok"] = out["large_ok"] = False
        out["problem"] = out["forbidden"]
    dist.report(**out)
    dist.print0(f"{args.func} as {args.op} on {n} ranks, S = {nbytes} B: "
                f"{'correct' if small_ok and large_ok else 'WRONG'}")
    sys.stdout.flush()
    dist.shutdown()


if __name__ == "__main__":
    main()
