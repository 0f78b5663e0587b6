"""What labkit.labs.ddp.exercise found on the ranks, and what is wrong with it, in sentences
with numbers: `DDPCheck`, which `run_user_ddp` returns and module 03's check cells read."""
from __future__ import annotations

from dataclasses import dataclass, field
from labkit.labs.common.checks import RTOL, first_bad, kinds_text, worst_ranks



@dataclass
class DDPCheck:
    """What run_user_ddp found: per step (max over ranks unless said), and the messages."""

    task: str
    name: str
    world_size: int
    steps: int
    error: str = ""                  # what the learner's code raised, and where
    refused: str = ""                # it wraps torch's DDP or labkit's
    has_module: bool = True
    construct_diff: float = 0.0      # |rank r's model after construction - rank 0's initial|
    construct_where: str = ""
    grad_ratio: list = field(default_factory=list)      # <yours, torch's> / <torch's, torch's>
    grad_diff: list = field(default_factory=list)       # max |yours - torch DDP's| (relative)
    grad_unsynced: list = field(default_factory=list)   # True: still each rank's own gradient
    grad_where: list = field(default_factory=list)      # the parameter with the largest diff
    diff_ddp: list = field(default_factory=list)        # params after the step vs torch DDP's
    diff_single: list = field(default_factory=list)     # ... vs one process, whole batch
    update_ratio: list = field(default_factory=list)    # your update / the single process's
    frozen_diff: float = 0.0
    all_reduces: list = field(default_factory=list)     # per step: (count, bytes), rank 0
    collectives: list = field(default_factory=list)     # per step: {kind: (count, bytes)}
    construct_collectives: dict = field(default_factory=dict)
    torch_all_reduces: list = field(default_factory=list)   # torch DDP's, same steps
    trainable_bytes: int = 0         # unique trainable parameters x 4 (what DDP must send)
    trainable_tensors: int = 0
    per_backward: tuple = (0, 0)     # accumulate: torch DDP's all-reduces in one synced backward
    micro: int = 1
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, task: str, name: str, steps: int, micro: int,
                     output=()) -> "DDPCheck":
        """From what each rank reported (`result.results[rank]`, ranks in order)."""
        first = rs[0]
        by = max(rs, key=lambda r: r["construct_diff"])
        return cls(
            task=task, name=name, world_size=len(rs), steps=steps,
            error=next((r["error"] for r in rs if r["error"]), ""),
            refused=next((r["refused"] for r in rs if r["refused"]), ""),
            has_module=all(r["has_module"] for r in rs), construct_diff=by["construct_diff"],
            construct_where=by["construct_where"], grad_ratio=first["grad_ratio"],
            grad_diff=worst_ranks(rs, "grad_diff"), grad_unsynced=first["grad_unsynced"],
            grad_where=first["grad_where"], diff_ddp=worst_ranks(rs, "diff_ddp"),
            diff_single=worst_ranks(rs, "diff_single"), update_ratio=first["update_ratio"],
            frozen_diff=max(r["frozen_diff"] for r in rs),
            all_reduces=[tuple(k.get("all_reduce", (0, 0))) for k in first["collectives"]],
            collectives=[{k: tuple(v) for k, v in c.items()} for c in first["collectives"]],
            construct_collectives={k: tuple(v) for k, v in first["construct_collectives"].items()},
            torch_all_reduces=[tuple(t) for t in first["torch_all_reduces"]],
            trainable_bytes=first["trainable_bytes"], trainable_tensors=first["trainable_tensors"],
            per_backward=tuple(first["per_backward"]), micro=micro if task == "accumulate" else 1,
            output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    @property
    def bytes_per_step(self) -> int:
        return self.all_reduces[0][1] if self.all_reduces else 0

    @property
    def count_per_step(self) -> int:
        return self.all_reduces[0][0] if self.all_reduces else 0

    def problems(self) -> list[str]:
        """One sentence per thing that is wrong, with its numbers ([] when all is right)."""
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong with it, or ""}. Aspects: "runs", "broadcast", "gradients",
        "parameters", "frozen", "bytes" (task "wrapper"); "runs", "all_reduces", "parameters",
        "frozen" (task "accumulate"). What the learner's code raised fails every aspect; a
        wrapper whose replicas did not start equal has its gradients and parameters not compared."""
        aspects = (("runs", "broadcast", "gradients", "parameters", "frozen", "bytes")
                   if self.task == "wrapper" else ("runs", "all_reduces", "parameters", "frozen"))
        fatal = self.refused or self.error
        if fatal:
            return dict.fromkeys(aspects, fatal)
        out = dict.fromkeys(aspects, "")
        if not self.has_module:
            out["runs"] = f"{self.name} keeps no `.module`: store the wrapped model as self.module"
        if self.task == "wrapper":
            self._wrapper_verdicts(out)
        else:
            self._accumulate_verdicts(out)
        if self.frozen_diff > 0:
            out["frozen"] = (f"a frozen parameter (requires_grad=False) changed by "
                             f"{self.frozen_diff:.3g}: never synchronise or update parameters "
                             "that do not require gradients")
        return out

    def _wrapper_verdicts(self, out: dict) -> None:
        n = self.world_size
        if self.construct_diff > RTOL:
            out["broadcast"] = (
                f"after {self.name}(model), a rank's model differs from rank 0's by up to "
                f"{self.construct_diff:.3g} (in {self.construct_where!r}): the replicas must "
                "start equal, every parameter and buffer taking rank 0's values when the "
                "wrapper is built")
            out["gradients"] = out["parameters"] = ("not compared: the replicas did not start "
                                                    "equal (" + out["broadcast"] + ")")
            return
        step = first_bad(self.grad_diff)
        if step is not None:
            ratio = self.grad_ratio[step]
            why = ("they are still each rank's own: nothing was all-reduced"
                   if self.grad_unsynced[step] else
                   f"yours / torch's = {ratio:.3f}: the sum over {n} ranks, not the average; "
                   "divide by the world size" if abs(ratio - n) < 1e-3 else
                   f"yours / torch's = {ratio:.3f} over all gradients")
            out["gradients"] = (f"after finish_gradient_synchronization() in step {step + 1}, "
                                f"gradients differ from torch DDP's by up to "
                                f"{self.grad_diff[step]:.3g} of the largest, in "
                                f"{self.grad_where[step]!r}; {why}")
        step = first_bad(self.diff_single)
        if step is not None:
            out["parameters"] = (f"after step {step + 1}, parameters differ from one process "
                                 f"trained on the whole batch by up to "
                                 f"{self.diff_single[step]:.3g} of the largest")
        got, want = self.bytes_per_step, self.trainable_bytes
        if any(b != want for _, b in self.all_reduces) or not self.all_reduces:
            out["bytes"] = (f"a step all-reduced {got:,} B in {self.count_per_step} calls; the "
                            f"trainable parameters hold {want:,} B ({self.trainable_tensors} "
                            f"tensors; ratio {got / want:.3f}): each trainable Parameter once "
                            "(the tied embedding/head weight is one), frozen ones never")

    def _accumulate_verdicts(self, out: dict) -> None:
        m = self.micro
        step = first_bad(self.diff_single)
        if step is not None:
            ratio = self.update_ratio[step]
            why = (f"the {m} micro-batches' gradients summed, not averaged"
                   if abs(ratio - m) < 1e-3 else "each rank's micro-batches once, then one "
                   "optimizer step")
            out["parameters"] = (f"after step {step + 1}, parameters differ from one process "
                                 f"trained on all ranks' micro-batches at once by up to "
                                 f"{self.diff_single[step]:.3g} of the largest; your update / "
                                 f"the reference's = {ratio:.3f} ({why})")
        got, want = self.count_per_step, self.per_backward[0]
        if any(c != want for c, _ in self.all_reduces) or not self.all_reduces:
            more = (f"{got} = {got / max(want, 1):g} x {want}: DDP all-reduces in every backward "
                    "it is allowed to synchronise; only the last micro-batch's should (the "
                    "others accumulate locally: DDP's no_sync)" if got > want else "the last "
                    "micro-batch's backward must synchronise, or nothing is averaged")
            out["all_reduces"] = (f"your step issued {got} all-reduces for {m} micro-batches; one "
                                  f"synchronised backward issues {want} (torch DDP's buckets): "
                                  + more)

    def summary(self) -> str:
        lines = [f"{self.name} ({self.task}) on {self.world_size} ranks, {self.steps} steps:"]
        if self.task == "wrapper":
            lines.append(f"  at construction: {kinds_text(self.construct_collectives)}")
        for s, kinds in enumerate(self.collectives):
            torch_ = (f"; torch DDP: {self.torch_all_reduces[s][0]} all-reduce(s), "
                      f"{self.torch_all_reduces[s][1]:,} B" if self.torch_all_reduces else "")
            diff = self.diff_ddp if self.task == "wrapper" else self.diff_single
            shown = "n/a" if s >= len(diff) or diff[s] is None else f"{diff[s]:.2g}"
            lines.append(f"  step {s + 1}: {kinds_text(kinds)}{torch_}; parameters vs "
                         f"{'torch DDP' if self.task == 'wrapper' else 'one process'}: {shown}")
        if self.task == "wrapper":
            lines.append(f"  trainable parameters: {self.trainable_tensors} tensors, "
                         f"{self.trainable_bytes:,} B")
        else:
            lines.append(f"  one synchronised backward: {self.per_backward[0]} all-reduce(s), "
                         f"{self.per_backward[1]:,} B")
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)



