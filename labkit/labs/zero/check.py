"""What labkit.labs.zero.exercise found on the ranks, and what is wrong with it, in sentences
with numbers: `ZeroCheck`, which `run_user_zero1` returns and module 04's check cell reads."""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.labs.common.checks import first_bad, kinds_text, worst_ranks

REDUCE_KINDS = ("reduce", "reduce_scatter", "all_reduce")     # collectives that sum gradients
SEND_KINDS = ("broadcast", "all_gather")                       # ... that send parameters


@dataclass
class ZeroCheck:
    """What run_user_zero1 found: per step (max over ranks), per rank, and the messages."""

    name: str
    world_size: int
    steps: int
    error: str = ""                  # what the learner's code raised, and where
    refused: str = ""                # it uses torch's ZeroRedundancyOptimizer or labkit's
    diff_single: list = field(default_factory=list)    # params after the step vs one process
    collectives: list = field(default_factory=list)    # per step: {kind: (count, bytes)}, rank 0
    held: list = field(default_factory=list)           # per rank: indices of params with state
    state_bytes: list = field(default_factory=list)    # per rank: bytes of that state
    sizes: list = field(default_factory=list)          # bytes of each trainable parameter
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, name: str, steps: int, output=()) -> "ZeroCheck":
        """From what each rank reported (`result.results[rank]`, ranks in order)."""
        return cls(name=name, world_size=len(rs), steps=steps,
                   error=next((r["error"] for r in rs if r["error"]), ""),
                   refused=next((r["refused"] for r in rs if r["refused"]), ""),
                   diff_single=worst_ranks(rs, "diff_single"),
                   collectives=[{k: tuple(v) for k, v in c.items()}
                                for c in rs[0]["collectives"]],
                   held=[list(r["held"]) for r in rs], state_bytes=[r["state_bytes"] for r in rs],
                   sizes=list(rs[0]["sizes"]), output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    @property
    def trainable_bytes(self) -> int:
        return sum(self.sizes)

    def _step_bytes(self, kinds) -> list[int]:
        return [sum(c.get(k, (0, 0))[1] for k in kinds) for c in self.collectives]

    @property
    def reduced_bytes(self) -> list[int]:
        """Per step: bytes of gradients passed to reduce / reduce_scatter / all_reduce."""
        return self._step_bytes(REDUCE_KINDS)

    @property
    def sent_bytes(self) -> list[int]:
        """Per step: bytes of parameters passed to broadcast / all_gather."""
        return self._step_bytes(SEND_KINDS)

    def problems(self) -> list[str]:
        """One sentence per thing that is wrong, with its numbers ([] when all is right)."""
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong with it, or ""}. Aspects: "runs", "parameters" (= one process
        with AdamW on the whole batch), "sharded" (each parameter's optimizer state on exactly
        one rank), "bytes" (each gradient reduced once, each parameter sent once per step)."""
        aspects = ("runs", "parameters", "sharded", "bytes")
        fatal = self.refused or self.error
        if fatal:
            return dict.fromkeys(aspects, fatal)
        out = dict.fromkeys(aspects, "")
        step = first_bad(self.diff_single)
        if step is not None:
            why = ("the gradients were never reduced: each rank stepped on its own"
                   if not self.reduced_bytes[step] else
                   "the updated parameters never left their owner" if not self.sent_bytes[step]
                   else "average the gradients (the reduce sums: divide by the world size), "
                        "step, then send each parameter from its owner")
            out["parameters"] = (f"after step {step + 1}, parameters differ from one process "
                                 f"trained with AdamW on the whole batch by up to "
                                 f"{self.diff_single[step]:.3g} of the largest: {why}")
        out["sharded"] = self._sharding()
        out["bytes"] = self._bytes()
        return out

    def _sharding(self) -> str:
        n, count = self.world_size, len(self.sizes)
        shared = [i for i in range(count) if sum(i in held for held in self.held) > 1]
        per_rank = ", ".join(f"rank {r}: {b:,} B" for r, b in enumerate(self.state_bytes))
        full, total = 2 * self.trainable_bytes, sum(self.state_bytes)   # AdamW: 2 moments
        if shared or not full <= total <= full + 2 * self._slack:
            which = f"parameters {shared} have optimizer state on several ranks; " if shared else ""
            return (f"{which}the ranks' optimizer states hold {total:,} B together ({per_rank}); "
                    f"one replica of AdamW's state is {full:,} B (ratio {total / full:.3f}): "
                    f"each rank's optimizer must hold only the parameters it owns, 1/{n} of "
                    "them, and every parameter must have one owner")
        return ""

    @property
    def _slack(self) -> int:
        """Bytes a flat buffer padded to a multiple of the world size may add."""
        return 4 * self.world_size * len(self.sizes)

    def _bytes(self) -> str:
        want, slack = self.trainable_bytes, self._slack
        for what, got in (("gradient bytes reduced", self.reduced_bytes),
                          ("parameter bytes sent", self.sent_bytes)):
            bad = next((i for i, b in enumerate(got) if not want <= b <= want + slack), None)
            if bad is not None or not got:
                b = got[bad] if got else 0
                return (f"step {(bad or 0) + 1}: {what} = {b:,} B; the trainable parameters "
                        f"hold {want:,} B (ratio {b / want:.3f}): ZeRO-1 reduces each gradient "
                        "once and sends each updated parameter once (the tied weight is one)")
        return ""

    def summary(self) -> str:
        lines = [f"{self.name} on {self.world_size} ranks, {self.steps} steps:"]
        for s, kinds in enumerate(self.collectives):
            diff = self.diff_single[s] if s < len(self.diff_single) else None
            shown = "n/a" if diff is None else f"{diff:.2g}"
            lines.append(f"  step {s + 1}: {kinds_text(kinds)}; parameters vs one process: {shown}")
        lines.append(f"  trainable parameters: {len(self.sizes)} tensors, "
                     f"{self.trainable_bytes:,} B; AdamW state of one replica: "
                     f"{2 * self.trainable_bytes:,} B")
        for r, (held, b) in enumerate(zip(self.held, self.state_bytes)):
            lines.append(f"  rank {r}: optimizer state for parameters {held}, {b:,} B")
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)
