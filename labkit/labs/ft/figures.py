"""The torchft lab's figures, from what the replica groups reported (labkit.labs.ft.group):
the crash lab's schema (strategy, losses, step_end, lost_seconds, goodput, ...) and torchft's
own (participants, healed_from, heal_step, goodput_samples, checksums, ...); `summary`, the
lines the command prints. Pure Python.
"""
from __future__ import annotations

import importlib.metadata

from labkit import resilience
from labkit.labs.ft.lighthouse import HEARTBEAT_SECONDS, JOIN_SECONDS, expected_detection


def figures(runs: list[list[dict]], restarted_at: float, *, steps: int, step_seconds: float,
            groups: int, group_size: int, restart_delay: float) -> dict:
    """The run's figures (measure() says what counts). runs: what rank 0 of each group
    reported, one dict per run (the last group's: before the kill, then restarted);
    restarted_at: when the restart was launched (time.time())."""
    survivor, (before, after) = runs[0][0], runs[-1]
    done = survivor["steps"]
    first_back = after["steps"][0] if after.get("steps") else {"healed": False}
    if not first_back["healed"]:
        raise RuntimeError(f"the restarted group did not heal from a peer before step {steps}"
                           " was committed: give it more steps after kill_at, or longer steps")
    t0, killed = done[0]["start"], before["killed"]
    wall = done[-1]["end"] - t0
    participants = [(r["step"], r["participants"]) for r in done]
    full_steps = sum(n for _, n in participants) / groups     # in global batches
    restart = first_back["end"] - killed["time"]
    broken = next(i for i, r in enumerate(done) if r["step"] == killed["step"])
    previous_end = done[broken - 1]["end"] if broken else t0
    healed_with = next(r for r in done if r["step"] == first_back["step"])
    detect = expected_detection(groups, step_seconds)
    predict = lambda count: resilience.ft_lost_seconds(           # noqa: E731
        restart, groups, step_seconds, detect_seconds=detect, count=count)
    checksums = {g: group_runs[-1].get("checksum") for g, group_runs in enumerate(runs)}
    return {
        "strategy": "torchft", "steps": steps,
        "losses": [(r["step"], r["loss"]) for r in done],
        "step_end": [r["end"] - t0 for r in done],
        "killed_at_step": killed["step"], "killed_at_seconds": killed["time"] - t0,
        "save_every": None, "step_seconds": step_seconds,
        "lost_seconds": wall - steps * step_seconds,
        "restart_seconds": restart,
        "predicted_lost_seconds": predict("steps"),
        "wall_seconds": wall, "goodput": steps * step_seconds / wall,
        # torchft's own
        "participants": participants,
        "healed_from": after.get("healed_from"), "heal_step": first_back["step"] - 1,
        "goodput_samples": full_steps * step_seconds / wall,
        "lost_sample_seconds": wall - full_steps * step_seconds,
        "predicted_lost_sample_seconds": predict("samples"),
        # how late the step the failure broke was committed: max(step, detect - step/2)
        "failed_step_seconds": done[broken]["end"] - previous_end - step_seconds,
        "heal_seconds": healed_with["end"] - healed_with["start"] - step_seconds,
        "restart_launched_seconds": restarted_at - killed["time"],
        "restart_delay": restart_delay,
        "failed_steps": [(f["step"], f["error"]) for f in survivor["failures"]],
        "checksums": checksums, "weights_equal": len(set(checksums.values())) == 1,
        "groups": groups, "group_size": group_size, "torchft": _version(),
        "lighthouse": {"heartbeat_seconds": HEARTBEAT_SECONDS, "join_seconds": JOIN_SECONDS,
                       "expected_detection_seconds": detect},
    }


def _version() -> str | None:
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return None



def summary(r: dict) -> str:
    shape = " -> ".join(str(n) for i, (_, n) in enumerate(r["participants"])
                        if i == 0 or n != r["participants"][i - 1][1])
    return (f"torchft {r['torchft']}: {r['steps']} steps of {r['step_seconds']:g} s in "
            f"{r['wall_seconds']:.2f} s; group {r['groups'] - 1} killed in step "
            f"{r['killed_at_step']}, back {r['restart_seconds']:.2f} s later (healed from group "
            f"{r['healed_from']} at step {r['heal_step']}); participants {shape}\n"
            f"lost {r['lost_seconds']:.2f} s of steps (predicted "
            f"{r['predicted_lost_seconds']:.2f} s), goodput {r['goodput']:.3f}; "
            f"samples: lost {r['lost_sample_seconds']:.2f} s (predicted "
            f"{r['predicted_lost_sample_seconds']:.2f} s), goodput {r['goodput_samples']:.3f}; "
            f"weights equal after healing: {r['weights_equal']}")
