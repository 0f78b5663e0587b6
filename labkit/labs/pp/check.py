"""What labkit.labs.pp.exercise found on the ranks, and what is wrong with it, in sentences with
numbers: `GPipeCheck`, which module 07's check cell reads. The ranks compute in float64, so a
difference above DIFF_TOL is a mistake, never rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SEED, LAYERS, HIDDEN, ROWS, MICROBATCHES = 1234, 8, 16, 2, 4

DIFF_TOL = 1e-9          # relative; float64 rounding is about 1e-15
ASPECTS = ("runs", "loss", "grads", "schedule", "p2p")


def _ops(order) -> str:
    return " ".join(f"{k}{j}" for k, j in order) or "nothing"


@dataclass
class GPipeCheck:
    """Your GPipe step as it ran on every rank (rank r: stage r)."""

    name: str
    world_size: int
    microbatches: int
    error: str = ""
    rows: list = field(default_factory=list)        # per rank: what labkit.labs.pp.exercise reported
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, name, microbatches, output=()) -> "GPipeCheck":
        err = next((r["error"] for r in rs if r.get("error")), "")
        if not err and any("grads" not in r for r in rs):
            err = "the ranks reported nothing"
        return cls(name, len(rs), microbatches, err, list(rs), list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        """One sentence per thing that is wrong (a fatal error once, not once per aspect)."""
        return list(dict.fromkeys(v for v in self.verdicts().values() if v))

    def peak_in_flight(self) -> list[int]:
        """Per rank: the most micro-batches forwarded and not yet backwarded at one time."""
        out = []
        for r in self.rows:
            held = peak = 0
            for kind, _ in r.get("order", []):
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
            out.append(peak)
        return out

    def verdicts(self) -> dict[str, str]:
        """{aspect: '' when right, else what is wrong}: "runs", "loss" (the last rank returns
        the mean over micro-batches of the loss, the others None), "grads" (every stage's
        gradients equal the whole model's on one process), "schedule" (GPipe's order: all m
        forwards, then the m backwards, as labkit.pipeline.simulate), "p2p" (m activations
        forward and m gradients back across each boundary, of the activation's size)."""
        if self.error:
            return dict.fromkeys(ASPECTS, self.error)
        return {"runs": "", "loss": self._loss(), "grads": self._grads(),
                "schedule": self._schedule(), "p2p": self._p2p()}

    def _loss(self) -> str:
        last = self.world_size - 1
        for r, row in enumerate(self.rows[:-1]):
            if row["loss_type"] != "NoneType":
                return (f"rank {r} returned a {row['loss_type']}; only the last rank ({last}) "
                        "computes the loss: return None on the others")
        row = self.rows[-1]
        got, want = row["loss"], row["ref_loss"]
        if got is None:
            return (f"the last rank returned a {row['loss_type']}; expected the step's loss, "
                    f"{want:.6f} (a float or a one-element tensor)")
        if not math.isclose(got, want, rel_tol=DIFF_TOL):
            m = self.microbatches
            why = (f": exactly {m} x the mean, the sum of the micro-batches' losses; divide by "
                   f"m = {m}" if math.isclose(got, m * want, rel_tol=1e-6) else "")
            return (f"the last rank returned a loss of {got:.6f}; the whole model on one "
                    f"process gives {want:.6f} (ratio {got / want:.4g}){why}")
        return ""

    def _grads(self) -> str:
        m = self.microbatches
        for r, row in enumerate(self.rows):
            g = row["grads"]
            if g["missing"]:
                return (f"stage {r}'s {', '.join(g['missing'][:3])} has no gradient: every "
                        "micro-batch's backward must reach this stage (the gradient of its "
                        "output comes from the next stage, and backpropagates from here)")
            if g["diff"] > DIFF_TOL:
                scale = g["scale"]
                why = (f": exactly {m} x: each micro-batch's loss must be divided by m = {m} "
                       "before its backward" if math.isclose(scale, m, rel_tol=1e-6) else
                       ": accumulated twice (a backward ran twice?)" if
                       math.isclose(scale, 2, rel_tol=1e-6) else "")
                return (f"stage {r}'s gradients differ from the whole model's on one process by "
                        f"up to {g['diff']:.3g} of their largest value (scale {scale:.4g} x)"
                        f"{why}")
        return ""

    def _schedule(self) -> str:
        m = self.microbatches
        for r, row in enumerate(self.rows):
            got, want = [list(o) for o in row["order"]], [list(o) for o in row["want_order"]]
            if got != want:
                return (f"stage {r} ran {_ops(got)}; GPipe (labkit.pipeline.simulate) runs "
                        f"{_ops(want)}: all {m} forwards, then the {m} backwards in the same "
                        "order")
        return ""

    def _p2p(self) -> str:

        m, n, size = self.microbatches, self.world_size, ROWS * HIDDEN
        for r, row in enumerate(self.rows):
            sent = sorted((p, k) for kind, p, k in row["p2p"] if kind in ("send", "isend"))
            got = sorted((p, k) for kind, p, k in row["p2p"] if kind in ("recv", "irecv"))
            neighbours = [q for q in (r - 1, r + 1) if 0 <= q < n]
            want = sorted((q, size) for q in neighbours for _ in range(m))
            for what, have in (("sent", sent), ("received", got)):
                if have != want:
                    listed = ", ".join(f"{have.count(x)} x {x[1]} values to/from rank {x[0]}"
                                       for x in sorted(set(have))) or "nothing"
                    return (f"rank {r} {what} {listed}; expected {m} messages of {size} values "
                            f"with each neighbour ({', '.join(map(str, neighbours))}): one "
                            "activation forward and one gradient back per micro-batch")
        return ""

    def summary(self) -> str:
        lines = [f"{self.name} (GPipe) on {self.world_size} ranks, {self.microbatches} "
                 "micro-batches:"]
        if not self.error:
            row = self.rows[-1]
            lines.append(f"  loss {row['loss']} (one process: {row['ref_loss']:.6f}); peak "
                         f"micro-batches in flight per stage: {self.peak_in_flight()}")
            lines += [f"  stage {r}: {_ops(row['order'])}" for r, row in enumerate(self.rows)]
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)
