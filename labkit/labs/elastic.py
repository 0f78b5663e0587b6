"""Elastic-restart lab: a rank is killed mid-training, torchrun restarts every rank, they resume
from the newest intact DCP checkpoint, and the losses equal an uninterrupted run's exactly.

    labkit run elastic -n 2 --max-restarts 1 -- --ckpt-dir /tmp/el --kill-at-step 5
    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 \
        -m labkit.labs.elastic --ckpt-dir /tmp/el --kill-at-step 5 --step-seconds 0.3

Every start resumes from --ckpt-dir; the kill fires in torchrun's first attempt only;
--step-seconds pads each step, so that the time lost is measurable against
labkit.resilience.restart_lost_seconds. From a notebook, a strategy (torchrun restarts the ranks,
or the job is launched again) and what it cost: `measure`. More: docs/labs.md, ## elastic.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time

from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common import resume
from labkit.labs.common.flags import positive_int, unwritable
from labkit.labs.common.fsdp_lm import check_model_flags, model_flags
from labkit.runtime import dist

TIMELINE = "timeline.jsonl"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"     # torchrun: 0, then 1, 2, ... after restarts
STRATEGIES = ("elastic", "relaunch", "uninterrupted")
MAX_STEP_SECONDS = 60.0


# ---------------------------------------------------------------------------------------------
# inside the ranks

def attempt() -> int:
    """Which start of the ranks this is under torchrun (0: the first; plain runs: 0)."""
    return int(os.environ.get(RESTART_COUNT, "0") or 0)


def note(ckpt_dir: str, **event) -> None:
    """Append one event to the timeline: one write of one line, flushed, so a rank killed right
    after still leaves it whole."""
    line = json.dumps({"time": time.time(), "attempt": attempt(), "pid": os.getpid(),
                       **event}) + "\n"
    with open(os.path.join(ckpt_dir, TIMELINE), "a", encoding="utf-8") as f:
        f.write(line)


def run(args, ctx) -> dict:
    from labkit.labs.common.fsdp_lm import (batch, check_world, finish_step, killed_rank,
                                            sharded)
    from labkit.parallel import checkpoint

    check_world(args, ctx)
    kill_rank = killed_rank(args.kill_rank, "--kill-rank", args.kill_at_step, ctx)
    rank0 = ctx.rank == 0
    if rank0:
        note(args.ckpt_dir, event="joined")               # processes up, rendezvous done
    model, opt = sharded(args)
    start, losses = 0, []
    if args.resume_from is not None:                      # the elastic pattern: always resume
        start, losses = resume.resume(args, model, opt, flag="--ckpt-dir")
        dist.print0(f"attempt {attempt()}: resumed from step {start}")
    if rank0:
        note(args.ckpt_dir, event="resumed", step=start)
    out = {"resumed_from": start, "attempt": attempt(), "losses": losses, "saves": []}
    for step in range(start + 1, args.steps + 1):
        begin = time.time()
        ids = batch(args, step, ctx)
        loss = model(input_ids=ids, labels=ids).loss
        if step == args.kill_at_step and ctx.rank == kill_rank and attempt() == 0:
            note(args.ckpt_dir, event="kill", rank=ctx.rank, step=step)
            print(f"rank {ctx.rank}: killing myself with SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append([step, finish_step(loss, opt, ctx)])
        if step % args.save_every == 0:
            checkpoint.save(model, opt, step, args.ckpt_dir,
                            extra={"losses": losses, "config": resume.config(args)})
            out["saves"].append(step)
        dist.progress(step, args.steps, loss=losses[-1][1])
        # the padding: every step, its save included, takes step_seconds while its work fits
        time.sleep(max(0.0, begin + args.step_seconds - time.time()))
        if rank0:
            note(args.ckpt_dir, event="step", step=step, begin=begin, end=time.time(),
                 loss=losses[-1][1])
            dist.report(**out)
    if rank0:
        dist.report(**out)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", default=None,
                   help="checkpoints and timeline.jsonl; every start resumes from here (needed)")
    p.add_argument("--steps", type=positive_int, default=8, help="steps in all (default 8)")
    p.add_argument("--save-every", type=positive_int, default=2,
                   help="checkpoint after every K-th step (default 2)")
    p.add_argument("--kill-at-step", type=positive_int, default=None,
                   help="kill --kill-rank with SIGKILL in this step (after its forward), in "
                        "torchrun's first attempt only (default: no kill)")
    p.add_argument("--kill-rank", type=int, default=None,
                   help="the rank killed (default: the last rank)")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="pad every step to this many seconds of wall time (default 0: none)")
    model_flags(p)
    return p


def parse_args(argv=None):
    """The flags, checked before any work; args.resume_from is the newest intact checkpoint of
    --ckpt-dir ((step, path)) or None."""
    p = _parser()
    args = p.parse_args(argv)
    check_model_flags(p, args)
    world = dist.world_size()
    if args.ckpt_dir is None:
        p.error("argument --ckpt-dir: needed (every start resumes from it); allowed: a folder")
    if unwritable(args.ckpt_dir):
        p.error(f"argument --ckpt-dir: {unwritable(args.ckpt_dir)}; allowed: a folder this user "
                "can write (made if missing)")
    if args.global_batch % world:
        p.error(f"argument --global-batch: {args.global_batch} does not split across {world} "
                f"ranks; allowed: a multiple of {world}")
    if args.kill_at_step is not None and args.kill_at_step > args.steps:
        p.error(f"argument --kill-at-step: {args.kill_at_step} is after the last step; "
                f"allowed: 1 to --steps ({args.steps})")
    if args.kill_rank is not None and not 0 <= args.kill_rank < world:
        p.error(f"argument --kill-rank: {args.kill_rank} is not a rank of this run ({world} "
                f"rank{'s' * (world > 1)}); allowed: 0 to {world - 1}")
    if not (math.isfinite(args.step_seconds) and 0 <= args.step_seconds <= MAX_STEP_SECONDS):
        p.error(f"argument --step-seconds: {args.step_seconds} is not a step time; allowed: 0 "
                f"(no padding) to {MAX_STEP_SECONDS:g} seconds")
    args.resume_from, skipped = resume.intact(args.ckpt_dir)
    for step, why in skipped:        # a damaged checkpoint is passed over, never loaded
        dist.print0(f"skipped the damaged checkpoint of step {step} ({why})")
    if args.resume_from is not None and resume.other_flags(args.resume_from[1], args):
        p.error(f"argument --ckpt-dir: its checkpoint {args.resume_from[1]!r} was saved by a run "
                f"with other flags ({resume.other_flags(args.resume_from[1], args)}); "
                "allowed: the same flags, or an empty folder")
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = dist.setup()
    try:
        run(args, ctx)
    except resume.LoadError as exc:     # every rank: one line, no traceback
        p = _parser()
        p.exit(2, f"{p.prog}: error: {exc}\n")
    dist.shutdown()


# ---------------------------------------------------------------------------------------------
# from a notebook: run a strategy, read its timeline, compare with labkit.resilience

def measure(strategy: str, nproc: int = 2, steps: int = 8, save_every: int = 3,
            kill_at: int = 5, step_seconds: float = 0.3, ckpt_dir=None, *,
            kill_rank: int | None = None, uninterrupted: bool = False,
            timeout: float = 240, quiet: bool = True, args=(), env=None) -> dict:
    """Run one strategy of recovering from a rank killed at step `kill_at` and return what it
    cost (the keys the torchft lab returns too):

    "elastic": one run_lab(max_restarts=1): torchrun's agent notices the death, stops the other
        ranks and starts them all again in place; they resume from the checkpoint.
    "relaunch": the job fails (run_lab raises LabError), and a new run_lab starts the job again
        from the checkpoint: a whole torchrun, imports and rendezvous, as a scheduler would.
    "uninterrupted": no kill (kill_at is ignored): the reference losses and wall time.

    Every run uses torchrun, so that the strategies differ only in how they restart. Returns
    {"strategy", "steps", "losses" [(step, loss)] and "step_end" (seconds since the first step
    began) of the final timeline, "killed_at_step", "save_every", "step_seconds", "lost_seconds"
    (wall - steps x step_seconds), "restart_seconds" (kill -> first step of the next start),
    "predicted_lost_seconds" (resilience.restart_lost_seconds of the work since the last
    checkpoint and the measured restart), "wall_seconds" (first step's start to last step's
    end), "goodput" (steps x step_seconds / wall)}, and besides: "since_checkpoint_seconds",
    "overrun_seconds" (steps longer than step_seconds, gaps between steps: a busy machine),
    "restart_parts", "restarts", "failures", "launch_seconds" (run_lab's wall, summed).
    uninterrupted=True adds "uninterrupted": the same for a run without the kill.
    ckpt_dir: where the runs' folders go (kept; each must not exist yet); None: a temporary
    folder, removed after. args: more flags of the lab (--hidden 128 ...); env: more variables
    for the ranks (run_lab's)."""
    import shutil
    import tempfile

    from labkit import validate
    validate.choice("strategy", strategy, STRATEGIES)
    nproc = validate.positive_int("nproc", nproc)
    steps = validate.positive_int("steps", steps)
    save_every = validate.positive_int("save_every", save_every)
    step_seconds = validate.non_negative("step_seconds", step_seconds, MAX_STEP_SECONDS)
    if strategy != "uninterrupted":
        kill_at = validate.positive_int("kill_at", kill_at, steps)
    kill_rank = nproc - 1 if kill_rank is None else kill_rank
    if not (isinstance(kill_rank, int) and 0 <= kill_rank < nproc):
        raise ValueError(f"kill_rank={kill_rank!r} is not a rank of nproc={nproc}; allowed: 0 "
                         f"to {nproc - 1}, or None (the last)")
    parent = tempfile.mkdtemp(prefix="labkit-elastic-") if ckpt_dir is None else os.fspath(ckpt_dir)
    try:
        folder = os.path.join(parent, strategy)
        if os.path.exists(folder):
            raise ValueError(f"ckpt_dir={parent!r} holds a run of {strategy!r} already "
                             f"({folder}); allowed: a folder without one, or None")
        flags = [*map(str, args), "--ckpt-dir", folder, "--steps", str(steps),
                 "--save-every", str(save_every), "--step-seconds", repr(step_seconds)]
        kill = ([] if strategy == "uninterrupted" else
                ["--kill-at-step", str(kill_at), "--kill-rank", str(kill_rank)])
        out = _run(strategy, nproc, flags, kill, timeout, quiet, env)
        out.update(_summary(_read(folder), steps, save_every, step_seconds,
                            None if strategy == "uninterrupted" else kill_at))
        out.update(strategy=strategy)
        if uninterrupted and strategy != "uninterrupted":
            out["uninterrupted"] = measure("uninterrupted", nproc, steps, save_every, kill_at,
                                           step_seconds, parent, timeout=timeout, quiet=quiet,
                                           args=args, env=env)
        return out
    finally:
        if ckpt_dir is None:
            shutil.rmtree(parent, ignore_errors=True)


def _run(strategy, nproc, flags, kill, timeout, quiet, env) -> dict:
    """Launch the strategy; {"restarts", "failures", "launch_seconds"}."""
    from labkit.runtime.launch import LabError, run_lab

    def launch(extra, restarts=0):
        return run_lab("labkit.labs.elastic", nproc=nproc, args=[*flags, *extra],
                       timeout=timeout, quiet=quiet, launcher="torchrun",
                       max_restarts=restarts, env=env)

    if strategy != "relaunch":
        result = launch(kill, 1 if strategy == "elastic" else 0)
        return {"restarts": result.restarts, "failures": result.failures,
                "launch_seconds": result.wall_time}
    try:
        launch(kill)
    except LabError as err:
        if err.reason != "signal" or err.rank != int(kill[-1]):
            raise                      # not the kill we asked for: a real failure
        failed = err
    else:
        raise RuntimeError("relaunch: the first run was to fail at the kill, and it finished")
    result = launch([])                # the same flags: it resumes from the checkpoint
    code = failed.result.ranks[failed.rank].exit_code
    head = str(failed).splitlines()[0]
    return {"restarts": 1, "launch_seconds": failed.result.wall_time + result.wall_time,
            "failures": [{"attempt": 0, "rank": failed.rank, "reason": failed.reason,
                          "exit_code": code, "signal": signal.Signals(-code).name
                          if code is not None and code < 0 else None, "exc_type": None,
                          "message": head[head.index(": ") + 2:], "time": None}]}


def _read(folder) -> list[dict]:
    with open(os.path.join(folder, TIMELINE), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _summary(events, steps, save_every, step_seconds, kill_at) -> dict:
    """The figures of a timeline: the final timeline is, for each step, its last record (a step
    done again after the restart replaces the one the kill made worthless)."""
    from labkit import resilience

    done = [e for e in events if e["event"] == "step"]
    final = {e["step"]: e for e in done}
    if sorted(final) != list(range(1, steps + 1)):
        raise RuntimeError(f"the timeline has steps {sorted(final)}; expected 1 to {steps}")
    t0 = done[0]["begin"]
    wall = final[steps]["end"] - t0
    out = {"steps": steps, "save_every": save_every, "step_seconds": step_seconds,
           "killed_at_step": kill_at,
           "losses": [(s, final[s]["loss"]) for s in range(1, steps + 1)],
           "step_end": [final[s]["end"] - t0 for s in range(1, steps + 1)],
           "wall_seconds": wall, "lost_seconds": wall - steps * step_seconds,
           "goodput": steps * step_seconds / wall if wall > 0 else 1.0,
           "overrun_seconds": _overrun(done, step_seconds)}
    kills = [e for e in events if e["event"] == "kill"]
    if kill_at is None or not kills:
        return {**out, "restart_seconds": 0.0, "predicted_lost_seconds": 0.0,
                "since_checkpoint_seconds": 0.0, "restart_parts": {}}
    died = kills[0]["time"]
    after = [e for e in events if e["time"] > died]
    first = next(e for e in after if e["event"] == "step")
    joined = next(e["time"] for e in after if e["event"] == "joined")
    resumed = next(e["time"] for e in after if e["event"] == "resumed")
    since = (kill_at - 1 - (kill_at - 1) // save_every * save_every) * step_seconds
    restart = first["begin"] - died
    return {**out, "restart_seconds": restart, "since_checkpoint_seconds": since,
            "killed_at_seconds": died - t0,
            "predicted_lost_seconds": resilience.restart_lost_seconds(since, restart),
            "restart_parts": {"start_and_rendezvous": joined - died,
                              "build_and_load": resumed - joined,
                              "to_first_step": first["begin"] - resumed}}


def _overrun(done, step_seconds) -> float:
    """Seconds by which the steps ran past their padding, and the gaps between consecutive
    steps of one start: time neither the padding nor a failure explains (a busy machine)."""
    total = sum(max(0.0, e["end"] - e["begin"] - step_seconds) for e in done)
    for a, b in zip(done, done[1:]):
        if b["pid"] == a["pid"] and b["step"] == a["step"] + 1:
            total += b["begin"] - a["end"]
    return total


if __name__ == "__main__":
    main()
