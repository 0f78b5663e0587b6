"""What labkit.labs.fsdp.exercise found on the ranks, and what is wrong with it, in sentences with
numbers: `WrapCheck` (tasks "wrap" and "policy") and `ResumeCheck` (task "resume"), which module
05's check cells read. The collectives are judged against labkit.comm.step_communication("fsdp").
"""
from __future__ import annotations

from dataclasses import dataclass, field

RTOL = 1e-4                  # fp32 FSDP vs one process: sums in another order
DTYPES = {None: None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
          "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _fatal(aspects, message) -> dict:
    return dict.fromkeys(aspects, message)


@dataclass
class WrapCheck:
    """What run_user_wrap / run_user_policy measured (rank 0's collectives, every rank's bytes)."""

    name: str
    world_size: int
    error: str = ""
    params: int = 0                                     # P, the model's parameters
    blocks: list = field(default_factory=list)          # the transformer blocks' module names
    units: list = field(default_factory=list)           # modules that are FSDP units ("" = root)
    unsharded: list = field(default_factory=list)      # parameters that are no DTensor
    local_bytes: list = field(default_factory=list)    # per rank: bytes of its parameters
    collectives: dict = field(default_factory=dict)    # step 2: {kind: (count, bytes, dtypes)}
    diff_single: float = float("nan")                  # params after 3 steps vs one process
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, name: str, output=()) -> "WrapCheck":
        first, err = rs[0], next((r["error"] for r in rs if r.get("error")), "")
        if err or "units" not in first:
            return cls(name=name, world_size=len(rs), error=err or "the ranks reported nothing",
                       output=list(output))
        return cls(name=name, world_size=len(rs), params=first["params"],
                   blocks=list(first["blocks"]), units=list(first["units"]),
                   unsharded=list(first["unsharded"]),
                   local_bytes=[r["local_bytes"] for r in rs],
                   collectives={k: (v[0], v[1], tuple(v[2]))
                                for k, v in first["collectives"].items()},
                   diff_single=max(r["diff_single"] for r in rs), output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self, **expected) -> list[str]:
        return list(dict.fromkeys(m for m in self.verdicts(**expected).values() if m))

    def sent(self, kind: str) -> tuple[int, int, tuple]:
        """(count, payload bytes, dtypes) of one step's `kind` collectives."""
        return self.collectives.get(kind, (0, 0, ()))

    def predicted(self, reshard_after_forward=True, param_dtype="fp32", reduce_dtype=None):
        """labkit.comm's StepComm for this model and world size under those options."""
        from labkit import comm
        from labkit.labs.common.tiny_llama import SPEC

        pd = DTYPES[param_dtype] or "float32"
        rd = DTYPES[reduce_dtype] or pd
        return comm.step_communication("fsdp", model=SPEC, dp=self.world_size,
                                       reshard_after_forward=reshard_after_forward,
                                       param_bytes=BYTES[pd], grad_bytes=BYTES[rd])

    def verdicts(self, reshard_after_forward=True, param_dtype="fp32",
                 reduce_dtype=None) -> dict[str, str]:
        """{aspect: what is wrong, or ""} against the expected options. Aspects: "runs",
        "units" (one per block, then the root), "bytes" (each rank holds 4P/N), "collectives"
        (counts, bytes and dtypes = labkit.comm's prediction), "trains" (= one process; fp32
        only: in bf16 the two differ by rounding)."""
        aspects = ("runs", "units", "bytes", "collectives", "trains")
        if self.error:
            return _fatal(aspects, self.error)
        out = dict.fromkeys(aspects, "")
        want_units = sorted(self.blocks + [""])
        if sorted(self.units) != want_units:
            missing = [u or "the root (the model itself)" for u in want_units
                       if u not in self.units]
            out["units"] = (f"the FSDP units are {[u or '<root>' for u in self.units]}; "
                            f"missing {missing}: each of the {len(self.blocks)} blocks is "
                            "an FSDP unit of its own, and the model the root unit")
        full = 4 * self.params
        bad = [(r, b) for r, b in enumerate(self.local_bytes) if b * self.world_size != full]
        if bad:
            r, b = bad[0]
            why = (f"{len(self.unsharded)} parameters are not sharded (e.g. "
                   f"{self.unsharded[0]})" if self.unsharded else "the shards are uneven")
            out["bytes"] = (f"rank {r} holds {b:,} B of parameters; 4P/N = {full:,} / "
                            f"{self.world_size} = {full // self.world_size:,} B (ratio "
                            f"{b * self.world_size / full:.3f}): {why}")
        out["collectives"] = self._collectives(reshard_after_forward, param_dtype, reduce_dtype)
        if (DTYPES[param_dtype] or "float32") == "float32" and not self.diff_single <= RTOL:
            out["trains"] = (f"after 3 SGD steps the parameters differ from one process "
                             f"trained on the whole batch by {self.diff_single:.3g} of the "
                             "largest: every parameter must be in an FSDP unit, so that its "
                             "gradient is averaged over the ranks")
        return out

    def _collectives(self, reshard, param_dtype, reduce_dtype) -> str:
        pred = self.predicted(reshard, param_dtype, reduce_dtype).payload
        dtypes = {"all_gather": DTYPES[param_dtype] or "float32"}
        dtypes["reduce_scatter"] = DTYPES[reduce_dtype] or dtypes["all_gather"]
        for kind, what in (("all_gather", "all-gathers (weights)"),
                           ("reduce_scatter", "reduce-scatters (gradients)")):
            want_n, want_b = pred.get(kind, (0, 0))
            n, b, got_dt = self.sent(kind)
            if n != want_n or b != round(want_b) or got_dt != (dtypes[kind],):
                return (f"one step's {what}: {n} calls, {b:,} B in {list(got_dt)}; expected "
                        f"{want_n}, {round(want_b):,} B in ['{dtypes[kind]}'] (labkit.comm "
                        f"for {len(self.blocks)} blocks + the root, reshard_after_forward="
                        f"{reshard}, ratio {b / want_b if want_b else float('nan'):.3f})")
        return ""

    def summary(self, **expected) -> str:
        lines = [f"{self.name} on {self.world_size} ranks: P = {self.params:,} parameters"]
        if not self.error:
            lines.append(f"  FSDP units: {[u or '<root>' for u in self.units]}")
            lines.append("  parameter bytes per rank: " + ", ".join(
                f"{b:,}" for b in self.local_bytes) + f" (4P/N = "
                f"{4 * self.params // self.world_size:,})")
            for kind in ("all_gather", "reduce_scatter"):
                n, b, dt = self.sent(kind)
                lines.append(f"  one step: {n} x {kind}, {b:,} B in all, {', '.join(dt)}")
            lines.append(f"  parameters vs one process after 3 steps: {self.diff_single:.2g}")
        problems = self.problems(**expected)
        lines += [f"  PROBLEM: {p}" for p in problems] or ["  all correct"]
        return "\n".join(lines)


@dataclass
class ResumeCheck:
    """What run_user_resume measured: losses per step (the mean over ranks) and the files."""

    name: str
    load_name: str
    world_size: int
    save_at: int
    error: str = ""
    uninterrupted: list = field(default_factory=list)
    before: list = field(default_factory=list)        # the second run, up to the save
    resumed: list = field(default_factory=list)       # after the load
    loaded_diff: float = float("nan")                 # params after the load vs those saved
    files: list = field(default_factory=list)         # what the save wrote
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, name: str, load_name: str, save_at: int,
                     output=()) -> "ResumeCheck":
        first, err = rs[0], next((r["error"] for r in rs if r.get("error")), "")
        if err or "resumed" not in first:
            return cls(name=name, load_name=load_name, world_size=len(rs), save_at=save_at,
                       error=err or "the ranks reported nothing", output=list(output))
        return cls(name=name, load_name=load_name, world_size=len(rs), save_at=save_at,
                   uninterrupted=first["uninterrupted"], before=first["before"],
                   resumed=first["resumed"], loaded_diff=max(r["loaded_diff"] for r in rs),
                   files=first["files"], output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    @property
    def loss_diff(self) -> float:
        after = self.uninterrupted[self.save_at:]
        return max((abs(a - b) for a, b in zip(self.resumed, after)), default=float("nan"))

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong, or ""}. Aspects: "runs", "model" (the parameters after your
        load = those saved), "resumed" (the losses after the resume = the uninterrupted run's,
        exactly), "sharded" (one .distcp file per rank and a .metadata: dcp.save)."""
        aspects = ("runs", "model", "resumed", "sharded")
        if self.error:
            return _fatal(aspects, self.error)
        out = dict.fromkeys(aspects, "")
        if self.loaded_diff != 0:
            out["model"] = (f"after {self.load_name}, the parameters differ from those saved by "
                            f"{self.loaded_diff:.3g} of the largest: the values loaded never "
                            "reached the model's parameters")
        if self.loss_diff != 0:
            step = next(i for i, (a, b) in enumerate(
                zip(self.resumed, self.uninterrupted[self.save_at:])) if a != b)
            why = ("the optimizer's state (AdamW's moments and step) was not restored: save "
                   "and load it beside the model's" if not out["model"] else
                   "the model was not restored")
            out["resumed"] = (f"step {self.save_at + step + 1}: loss {self.resumed[step]:.8f} "
                              f"after the resume, {self.uninterrupted[self.save_at + step]:.8f}"
                              f" uninterrupted (largest difference {self.loss_diff:.3g}): {why}")
        shards = [f for f in self.files if f.endswith(".distcp")]
        if ".metadata" not in self.files or len(shards) != self.world_size:
            out["sharded"] = (f"the checkpoint directory holds {self.files}: "
                              f"torch.distributed.checkpoint.save writes one .distcp file per "
                              f"rank ({self.world_size}) and a .metadata, every rank saving its "
                              "own shards (no full copy on rank 0)")
        return out

    def summary(self) -> str:
        lines = [f"{self.name} / {self.load_name} on {self.world_size} ranks, saved after step "
                 f"{self.save_at}:"]
        if not self.error:
            for s, loss in enumerate(self.uninterrupted):
                r = s - self.save_at
                after = (f"{self.before[s]:.8f}" if s < self.save_at else
                         f"{self.resumed[r]:.8f} (resumed)" if r < len(self.resumed) else "n/a")
                lines.append(f"  step {s + 1}: uninterrupted {loss:.8f}, interrupted {after}")
            lines.append(f"  checkpoint files: {self.files}")
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)
