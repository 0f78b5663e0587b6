"""What labkit.labs.threed.exercise found on the ranks, and what is wrong with it, in sentences
with numbers: `TwoDCheck`, which module 08's check cell of exercise "compose" reads."""
from __future__ import annotations

from dataclasses import dataclass, field

RTOL = 1e-4              # fp32 on 4 ranks vs one process: the same sums in another order
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
TP_LINEARS = COLWISE + ROWWISE
TP_SHARD = {**dict.fromkeys(COLWISE, "Shard(0)"), **dict.fromkeys(ROWWISE, "Shard(1)")}


def layer_linear(name: str) -> str | None:
    """"q_proj" for "model.layers.0.self_attn.q_proj.weight"; None for other parameters."""
    parts = name.split(".")
    return parts[-2] if ".layers." in name and len(parts) > 2 and parts[-2] in TP_LINEARS \
        else None


@dataclass
class TwoDCheck:
    """What run_user_2d measured: placements (rank 0), every rank's bytes and losses."""

    name: str
    world_size: int
    error: str = ""
    placements: dict = field(default_factory=dict)     # param -> {axis: placement}
    local_bytes: list = field(default_factory=list)    # per rank
    predicted_bytes: int = 0
    whole_bytes: int = 0
    losses: list = field(default_factory=list)         # per step, mean over the ranks
    single_losses: list = field(default_factory=list)  # one process on the whole batch
    diff_single: float = float("nan")                  # params after the steps vs one process
    output: list = field(default_factory=list, repr=False)

    @classmethod
    def from_reports(cls, rs: list, *, name: str, output=()) -> "TwoDCheck":
        first, err = rs[0], next((r["error"] for r in rs if r.get("error")), "")
        if err or "losses" not in first:
            return cls(name=name, world_size=len(rs), error=err or "the ranks reported nothing",
                       output=list(output))
        return cls(name=name, world_size=len(rs), placements=dict(first["placements"]),
                   local_bytes=[r["local_bytes"] for r in rs],
                   predicted_bytes=first["predicted_bytes"], whole_bytes=first["whole_bytes"],
                   losses=list(first["losses"]), single_losses=list(first["single_losses"]),
                   diff_single=max(r["diff_single"] for r in rs), output=list(output))

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        return list(dict.fromkeys(m for m in self.verdicts().values() if m))

    def verdicts(self) -> dict[str, str]:
        """{aspect: what is wrong, or ""}. Aspects: "runs", "tp" (each layer's seven Linears
        sharded over the "tp" axis, column-wise by output, row-wise by input), "fsdp" (every
        parameter sharded over "dp"), "bytes" (each rank's = the prediction), "loss" (every
        step's = one process's), "trains" (the parameters after the steps = one process's)."""
        aspects = ("runs", "tp", "fsdp", "bytes", "loss", "trains")
        if self.error:
            return dict.fromkeys(aspects, self.error)
        out = dict.fromkeys(aspects, "")
        out["tp"] = self._tp()
        plain = [n for n, p in self.placements.items()
                 if not p.get("dp", "").startswith("Shard")]
        if plain:
            where = self.placements[plain[0]] or "a plain tensor"
            out["fsdp"] = (f"{len(plain)} of {len(self.placements)} parameters are not sharded "
                           f"over the 'dp' axis (e.g. {plain[0]}: {where}): each decoder "
                           "layer, then the root, is an FSDP unit over the mesh's 'dp' axis")
        held, want = max(self.local_bytes), self.predicted_bytes
        if held != want:
            out["bytes"] = (f"a rank holds {held:,} B of parameters; predicted {want:,} B "
                            f"(ratio {held / want:.2f}; the whole model is "
                            f"{self.whole_bytes:,} B): the layers' Linears split over tp x dp, "
                            "the rest over dp")
        bad = [(k, a, b) for k, (a, b) in enumerate(zip(self.losses, self.single_losses))
               if abs(a - b) > RTOL * abs(b)]
        if bad:
            k, a, b = bad[0]
            out["loss"] = (f"step {k}: loss {a:.6f} on the ranks, {b:.6f} on one process "
                           f"(relative difference {abs(a - b) / abs(b):.1e}, allowed {RTOL:g}): "
                           "the ranks of a TP group must see the same rows, those of the dp "
                           "axis different ones")
        if not self.diff_single <= RTOL:
            out["trains"] = (f"after {len(self.losses)} SGD steps the parameters differ from "
                             f"one process's by {self.diff_single:.1e} (relative, allowed "
                             f"{RTOL:g}): the gradients must be averaged over the 'dp' axis "
                             "(FSDP does it) and summed over 'tp' where the layers need it "
                             "(the DTensor styles do it)")
        return out

    def _tp(self) -> str:
        for name, places in self.placements.items():
            linear = layer_linear(name)
            if linear and places.get("tp") != TP_SHARD[linear]:
                how = ("column-parallel: each tp rank keeps a block of the weight's rows, its "
                       "output features" if linear in COLWISE else "row-parallel: each tp "
                       "rank keeps a block of the weight's columns, its input features")
                got = places.get("tp", "not sharded") if places else "a plain tensor"
                return (f"{name} is {got} on the 'tp' axis; expected {TP_SHARD[linear]} "
                        f"({how})")
        return ""

    def summary(self) -> str:
        lines = [f"{self.name}: TP x FSDP on {self.world_size} ranks "
                 f"(dp={self.world_size // 2} x tp=2):"]
        if not self.error:
            lines.append(f"  parameter bytes per rank: "
                         f"{', '.join(format(b, ',') for b in self.local_bytes)} "
                         f"(predicted {self.predicted_bytes:,}; whole model "
                         f"{self.whole_bytes:,})")
            lines.append("  loss per step: " + ", ".join(
                f"{a:.5f} (one process {b:.5f})" for a, b in zip(self.losses,
                                                                 self.single_losses)))
        lines += [f"  PROBLEM: {p}" for p in self.problems()] or ["  all correct"]
        return "\n".join(lines)
