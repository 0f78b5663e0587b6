"""What labkit.labs.tp.exercise found on the ranks, and what is wrong with it, in sentences with
numbers: `ConjugateCheck` (task "conjugates": f and g) and `LinearCheck` (tasks "column" and
"row"), which module 06's check cells read. Every value is a whole number, so every comparison
is exact: a difference is a mistake, never rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SEED, SEQ, ROWS, HIDDEN, FFN = 1234, 4, 2, 8, 32     # widths divide by 2, 4 and 8
SHAPES = {"column": (HIDDEN, FFN), "row": (FFN, HIDDEN)}     # (in, out) of the Linear

FP32 = 4


def _fatal(aspects, message) -> dict:
    return dict.fromkeys(aspects, message)


def _worst(rows: list, key: str):
    """(rank, comparison) of the rank whose `key` is furthest from the definition (nan, a wrong
    shape or no tensor at all, counts as the furthest)."""
    def badness(i):
        cmp = rows[i].get(key)
        d = cmp["diff"] if cmp else math.nan
        return math.inf if math.isnan(d) else d
    rank = max(range(len(rows)), key=badness)
    return rank, rows[rank].get(key)


def _calls(kinds: dict) -> str:
    return ", ".join(f"{v[0]} {k} ({v[1]:,} B)" for k, v in sorted(kinds.items())) or "none"


def _off(what: str, rank: int, cmp: dict | None, want: str) -> str:
    """'' when `cmp` matches, else a sentence: `what` on `rank` is not `want`."""
    if cmp is None:
        return f"{what}: none on rank {rank} (the output does not require grad)"
    if cmp["shape"] is None:
        return f"{what} on rank {rank} is a {cmp['what']}, not a tensor of shape {cmp['want_shape']}"
    if cmp["shape"] != cmp["want_shape"]:
        return f"{what} on rank {rank} has shape {cmp['shape']}; expected {cmp['want_shape']} ({want})"
    if cmp["diff"] != 0:
        return f"{what} on rank {rank} differs from {want} by up to {cmp['diff']:g}"
    return ""


@dataclass
class ConjugateCheck:
    """Megatron's f and g as you wrote them, on every rank (each rank its own x and dy)."""

    names: tuple
    world_size: int
    error: str = ""
    rows: list = field(default_factory=list)       # per rank: {"F": {...}, "G": {...}}
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, names, output=()) -> "ConjugateCheck":
        err = next((r["error"] for r in rs if r.get("error")), "")
        if not err and any("G" not in r for r in rs):
            err = "the ranks reported nothing"
        return cls(names=tuple(names), world_size=len(rs), error=err,
                   rows=[] if err else [{"F": r["F"], "G": r["G"]} for r in rs],
                   output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    def collectives(self, op: str, phase: str) -> dict:
        """Rank 0's {kind: (count, bytes, dtypes)} of `op`'s ("F"/"G") `phase` ("fwd"/"bwd")."""
        return {k: tuple(v) for k, v in self.rows[0][op][phase].items()} if self.rows else {}

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong, or ""}. Aspects: "runs", "F.forward" (= x), "F.backward"
        (= the sum of every rank's dy), "G.forward" (= the sum of every rank's x), "G.backward"
        (= dy), "collectives" (one all-reduce: F in the backward, G in the forward)."""
        aspects = ("runs", "F.forward", "F.backward", "G.forward", "G.backward", "collectives")
        if self.error:
            return _fatal(aspects, self.error)
        out = dict.fromkeys(aspects, "")
        f, g = self.names
        n = self.world_size
        wants = {("F", "y"): (f, "forward", "x itself (f is the identity in the forward)",
                              "the sum over ranks: that is g's forward"),
                 ("F", "grad"): (f, "backward", f"the sum of the {n} ranks' dy (f's backward "
                                 "all-reduces)", "dy itself: that is g's backward"),
                 ("G", "y"): (g, "forward", f"the sum of the {n} ranks' x (g all-reduces)",
                              "x itself: that is f's forward"),
                 ("G", "grad"): (g, "backward", "dy itself (g's backward is the identity)",
                                 "the sum over ranks: that is f's backward")}
        for (op, key), (name, phase, want, mistake) in wants.items():
            rank, cmp = _worst([r[op] for r in self.rows], key)
            msg = _off(f"{name}'s {phase} ({'its output' if key == 'y' else 'x.grad'})",
                       rank, cmp, want)
            if msg and cmp and cmp["alt"]:
                msg += f"; it equals {mistake}"
            out[f"{op}.{phase}"] = msg
        nbytes = math.prod(self.rows[0]["F"]["y"]["want_shape"]) * FP32
        for op, name, phase in (("F", f, "bwd"), ("G", g, "fwd")):
            for ph in ("fwd", "bwd"):
                got = {k: v[:2] for k, v in self.collectives(op, ph).items()}
                want = {"all_reduce": (1, nbytes)} if ph == phase else {}
                if got != want:
                    out["collectives"] = out["collectives"] or (
                        f"{name}'s {'forward' if ph == 'fwd' else 'backward'} issued "
                        f"{_calls(got)}; expected {_calls(want)}: f all-reduces only in the "
                        "backward, g only in the forward")
        return out

    def summary(self) -> str:
        f, g = self.names
        lines = [f"{f} and {g} on {self.world_size} ranks:"]
        if not self.error:
            for op, name in (("F", f), ("G", g)):
                lines.append(f"  {name}: forward issued {_calls(self.collectives(op, 'fwd'))}; "
                             f"backward {_calls(self.collectives(op, 'bwd'))}")
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)


def _split_diagnosis(kind: str, name: str, rs: list) -> str:
    """Why a layer whose weight was split along the wrong dimension failed (torch says only
    "mat1 and mat2 shapes cannot be multiplied"), from the weight each rank held: '' when every
    rank's weight has the shard's shape."""
    for rank, r in enumerate(rs):
        cmp = r.get("weight")
        if not cmp or not cmp.get("shape") or cmp["shape"] == cmp["want_shape"]:
            continue
        n_in, n_out = SHAPES[kind]
        features = ("output features, dim 0: a block of its rows" if kind == "column" else
                    "input features, dim 1: a block of its columns")
        return (f"\n  why: {name}.weight on rank {rank} has shape {cmp['shape']}, not the "
                f"shard's {cmp['want_shape']}. nn.Linear({n_in}, {n_out}) stores its weight as "
                f"(out_features, in_features) = ({n_out}, {n_in}); a {kind}-parallel layer "
                f"splits its {features}. Split along the other dimension, the weight no longer "
                "matches the input it multiplies.")
    return ""


@dataclass
class LinearCheck:
    """A column- or row-parallel layer of yours against nn.Linear on one process."""

    kind: str                                        # "column" or "row"
    name: str
    world_size: int
    uses: list = field(default_factory=list)
    error: str = ""
    rows: list = field(default_factory=list)         # what each rank reported
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, kind, name, uses=(), output=()) -> "LinearCheck":
        err = next((r["error"] for r in rs if r.get("error")), "")
        if not err and any("bwd" not in r for r in rs):
            err = "the ranks reported nothing"
        if "NameError" in err and not uses:
            err += (" (a class or function from another cell? pass it: "
                    f"run_user_{kind}({name}, uses=(F, G)))")
        if err:
            err += _split_diagnosis(kind, name, rs)
        return cls(kind=kind, name=name, world_size=len(rs), uses=list(uses), error=err,
                   rows=[] if err else list(rs), output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    def collectives(self, phase: str) -> dict:
        """Rank 0's {kind: (count, bytes, dtypes)} in the forward ("fwd") or backward ("bwd")."""
        return {k: tuple(v) for k, v in self.rows[0][phase].items()} if self.rows else {}

    def expected_bytes(self) -> int:
        """Parameter bytes per rank: column W/N + b/N; row W/N + the whole b."""

        n_in, n_out = SHAPES[self.kind]
        bias = n_out // self.world_size if self.kind == "column" else n_out
        return FP32 * (n_in * n_out // self.world_size + bias)

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong, or ""}. Aspects: "runs", "shard" (.weight and .bias are this
        rank's slices, and nothing more is held), "output", "input_grad", "param_grads" (the
        weight's and bias's gradients: this rank's slices of nn.Linear's), "collectives"."""
        aspects = ("runs", "shard", "output", "input_grad", "param_grads", "collectives")
        if self.error:
            return _fatal(aspects, self.error)

        out = dict.fromkeys(aspects, "")
        column, n = self.kind == "column", self.world_size
        n_in, n_out = SHAPES[self.kind]
        part = (f"rows i*{n_out}/{n} to (i+1)*{n_out}/{n} of nn.Linear's weight (output "
                "features)" if column else f"columns i*{n_in}/{n} to (i+1)*{n_in}/{n} of "
                "nn.Linear's weight (input features)")
        bias = "this rank's slice of the bias" if column else "the whole bias"
        shard = [_off(f"{self.name}.weight", *_worst(self.rows, "weight"), part),
                 _off(f"{self.name}.bias", *_worst(self.rows, "bias"), bias)]
        held, want = max(r["local_bytes"] for r in self.rows), self.expected_bytes()
        if held != want:
            shard.append(f"a rank holds {held:,} B of parameters; expected {want:,} B "
                         f"(ratio {held / want:.2f}): keep only this rank's shard")
        out["shard"] = next((m for m in shard if m), "")
        rank, cmp = _worst(self.rows, "output")
        want_y = (f"nn.Linear's output columns of rank {rank} (gather_output=False)" if column
                  else "nn.Linear's whole output (on every rank)")
        out["output"] = _off("the output", rank, cmp, want_y)
        if out["output"] and column and cmp["shape"] and cmp["shape"][-1] == n_out:
            out["output"] += (f": it was gathered to all {n_out} columns; Megatron keeps it "
                              "split, and the row-parallel layer takes it as it is")
        elif out["output"] and cmp and cmp["alt"]:
            out["output"] += (": it is this rank's partial sum; all-reduce it (g) before "
                              "adding the bias")
        elif out["output"] and self.rows[rank].get("bias_added_n_times"):
            out["output"] += (f": exactly {n - 1} x the bias too many: add the bias once, "
                              "after the all-reduce, not on every rank before it")
        rank, cmp = _worst(self.rows, "input_grad")
        out["input_grad"] = _off("x.grad", rank, cmp, "nn.Linear's input gradient" +
                                 ("" if column else f" (rank {rank}'s columns)"))
        if out["input_grad"] and cmp and cmp["alt"]:
            out["input_grad"] += (": it is this rank's partial sum dy_i W_i; the backward "
                                  "must all-reduce it (f before the matmul)")
        out["param_grads"] = (_off(f"{self.name}.weight.grad", *_worst(self.rows, "weight_grad"),
                                   "that slice of nn.Linear's weight gradient") or
                              _off(f"{self.name}.bias.grad", *_worst(self.rows, "bias_grad"),
                                   "that slice of nn.Linear's bias gradient" if column
                                   else "nn.Linear's bias gradient"))
        out["collectives"] = self._collectives()
        skipped = next((r["skipped"] for r in self.rows if r.get("skipped")), "")
        if skipped:
            out.update(input_grad=skipped, param_grads=skipped)
            if out["collectives"].startswith("the backward"):
                out["collectives"] = skipped
        return out

    def _collectives(self) -> str:

        size = SEQ * ROWS * HIDDEN * FP32           # x's gradient (column) = the output (row)
        phase = "bwd" if self.kind == "column" else "fwd"
        for ph, word in (("fwd", "forward"), ("bwd", "backward")):
            got = {k: v[:2] for k, v in self.collectives(ph).items()}
            want = {"all_reduce": (1, size)} if ph == phase else {}
            if got != want:
                why = ("column-parallel: nothing in the forward, one all-reduce of x's gradient "
                       "in the backward (f)" if self.kind == "column" else "row-parallel: one "
                       "all-reduce of the output in the forward (g), nothing in the backward")
                return f"the {word} issued {_calls(got)}; expected {_calls(want)} ({why})"
        return ""

    def summary(self) -> str:
        lines = [f"{self.name} ({self.kind}-parallel) on {self.world_size} ranks:"]
        if not self.error:
            lines.append(f"  parameter bytes per rank: "
                         f"{', '.join(format(r['local_bytes'], ',') for r in self.rows)} "
                         f"(expected {self.expected_bytes():,})")
            lines.append(f"  forward issued {_calls(self.collectives('fwd'))}; backward "
                         f"{_calls(self.collectives('bwd'))}")
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)
