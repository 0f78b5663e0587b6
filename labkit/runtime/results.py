"""What a lab run gives back: `LabResult` (how each rank ended, what it reported) and `LabError`
(a failed, timed-out or unstartable lab: which rank, why, its traceback)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankResult:
    """How one rank ended: exit_code (None if unknown; negative = killed by that signal) and
    wall_time in seconds from its start to its exit (or to the teardown)."""

    rank: int
    exit_code: int | None
    wall_time: float | None
    pid: int | None = None
    host: str | None = None


@dataclass
class LabResult:
    target: str
    nproc: int
    ranks: list[RankResult]
    results: list[dict]          # indexed by rank: the union of what that rank report()ed
    wall_time: float             # seconds from run_lab's call to its return
    returncode: int | None       # the launcher's exit status (0: every rank exited 0)
    output: list[str] = field(default_factory=list, repr=False)      # "[rank R] ..." lines
    agent_log: list[str] = field(default_factory=list, repr=False)   # torchrun's own lines
    run_id: str = ""
    launcher: str = "torchrun"   # "pool" (warm processes, labkit.runtime.pool) or "torchrun"
    # run_lab(max_restarts=N): how many times torchrun restarted the ranks, and how each earlier
    # attempt failed ({"attempt", "rank", "reason", "exit_code", "signal", "exc_type",
    # "message", "time"}: labkit.runtime.verdict); the rest of the result is the last attempt's
    restarts: int = 0
    failures: list[dict] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        # ranks with no pid ran on other nodes (multi-node): this node knows nothing of them
        return self.returncode == 0 and all(r.exit_code == 0 for r in self.ranks
                                            if r.pid is not None)

    def __repr__(self) -> str:
        state = "ok" if self.ok else "failed"
        return (f"LabResult(target={self.target!r}, nproc={self.nproc}, "
                f"wall_time={self.wall_time:.2f} s, {state}"
                + (f", restarts={self.restarts})" if self.restarts else ")"))


class LabError(RuntimeError):
    """A lab failed, timed out or could not start. The message names the rank, the exception
    type and message, and shows the first failing rank's traceback.

    Attributes: rank (first failing rank or None), exc_type, exc_message, traceback,
    reason ("exception" | "exit" | "signal" | "timeout" | "launcher" | "rendezvous": the nodes
    never met), result (a LabResult).
    """

    def __init__(self, message: str, *, reason: str, rank: int | None = None,
                 exc_type: str | None = None, exc_message: str | None = None,
                 traceback: str | None = None, result: LabResult | None = None):
        super().__init__(message)
        self.reason, self.rank, self.exc_type = reason, rank, exc_type
        self.exc_message, self.traceback, self.result = exc_message, traceback, result
