"""One replica group of the torchft lab (labkit.labs.ft): the crash lab's Llama trained under
torchft's Manager, its gradient averaged over the quorum's groups by a fault-tolerant all-reduce.

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 --join_timeout_ms 500 \
        --heartbeat_timeout_ms 1000                                      # then, 2 terminals:
    torchrun --standalone --nproc-per-node 1 -m labkit.labs.ft.group --group 0 \
        --lighthouse http://127.0.0.1:29510 --steps 300
    torchrun --standalone --nproc-per-node 1 -m labkit.labs.ft.group --group 1 \
        --lighthouse http://127.0.0.1:29510 --steps 300 --kill-at 8   # again, --rejoin: heals

`labkit.labs.ft.measure()` runs and times all of it. A step: `train`; more: docs/labs.md, ## ft.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import signal
import statistics
import time
import warnings
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as tdist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from labkit.labs.common import fsdp_lm
from labkit.labs.common.flags import between, positive_int
from labkit.runtime import dist

# torchft's timeouts (its defaults are 60 s): an all-reduce, a commit vote or a checkpoint
# fetch that takes longer on a laptop is broken, not slow.
TIMEOUT = timedelta(seconds=30)
QUORUM_TIMEOUT = timedelta(seconds=60)
READY_WAIT = 120.0        # seconds the first groups wait for each other before step 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, required=True, help="this replica group's number, 0 to "
                   "--groups - 1 (its share of each step's batch)")
    p.add_argument("--groups", type=positive_int, default=2,
                   help="replica groups that split each step's global batch (default 2)")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="the lighthouse's address, e.g. http://127.0.0.1:29510 (default "
                        "$TORCHFT_LIGHTHOUSE)")
    p.add_argument("--steps", type=positive_int, default=30, help="steps to commit (default 30)")
    p.add_argument("--step-seconds", type=between(0, 60, "a number of seconds"), default=0.3,
                   help="each step padded to this wall time (default 0.3)")
    p.add_argument("--kill-at", type=positive_int, default=None,
                   help="rank 0 of this group kills itself with SIGKILL in the middle of this step")
    p.add_argument("--rejoin", action="store_true",
                   help="a restarted group: its first step must heal from a peer ahead of it")
    p.add_argument("--run-dir", default=None,
                   help="a folder the groups share with whoever watches them: the first groups "
                        "wait there for each other before step 1 (so that the first quorum "
                        "holds them all), and each logs its committed steps there as they go")
    fsdp_lm.model_flags(p)
    args = p.parse_args(argv)
    fsdp_lm.check_model_flags(p, args)
    if not 0 <= args.group < args.groups:
        p.error(f"argument --group: {args.group} is not a group of --groups {args.groups}; "
                f"allowed: 0 to {args.groups - 1}")
    if not args.lighthouse:
        p.error("argument --lighthouse is missing (and TORCHFT_LIGHTHOUSE is not set): start "
                "torchft_lighthouse and give its address, e.g. http://127.0.0.1:29510")
    return args


def share(args, ctx) -> SimpleNamespace:
    """This rank's place in the data: the global batch splits over groups x group size, and
    group g's rank r takes slice g x size + r, whoever else is alive."""
    return SimpleNamespace(world_size=args.groups * ctx.world_size,
                           rank=args.group * ctx.world_size + ctx.rank, device=ctx.device)


def make_manager(args, model, opt, healed: dict):
    """torchft's Manager for this rank. Its state (what a healing peer fetches) is the model,
    the optimizer and this group's number, so that the healed group can say whom it healed
    from. init_sync=False: every group builds the same weights from the same seed, so step 1
    needs no copy."""
    from torchft import Manager, ProcessGroupGloo

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict(), "group": args.group}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        healed["from"] = state["group"]

    return Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=load_state_dict,
                   state_dict=state_dict, min_replica_size=1, replica_id=f"group{args.group}",
                   lighthouse_addr=args.lighthouse, hostname="localhost", init_sync=False,
                   timeout=TIMEOUT, quorum_timeout=QUORUM_TIMEOUT, connect_timeout=TIMEOUT)


def wait_for_groups(args, ctx) -> None:
    """The first groups meet before step 1 (a file each in --run-dir): without it the first
    group to start commits its first steps alone, and the quorum goes 1 -> 2 before any kill."""
    if not args.run_dir or args.rejoin:
        return
    if ctx.rank == 0:
        open(os.path.join(args.run_dir, f"ready{args.group}"), "w").close()
    deadline = time.monotonic() + READY_WAIT
    while len([n for n in os.listdir(args.run_dir) if n.startswith("ready")]) < args.groups:
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {args.group}: the other groups did not start within "
                               f"{READY_WAIT:.0f} s (files in {args.run_dir})")
        time.sleep(0.02)


def log_step(args, record: dict) -> None:
    """One committed step, appended to --run-dir/steps<group>.jsonl as it happens (the driver
    restarts a killed group once it sees the quorum go on without it)."""
    if args.run_dir:
        with open(os.path.join(args.run_dir, f"steps{args.group}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def average_gradients(manager, params, ctx) -> None:
    """Gradients -> their average over every rank of every participating group, as one flat
    buffer. Within the group: plain torch.distributed (a rank lost here ends its whole group).
    Across groups: manager.allreduce, which averages over the quorum's participants and, if a
    peer dies, records the error for should_commit to refuse instead of raising (a healing
    group contributes zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    if ctx.world_size > 1:
        tdist.all_reduce(flat)
        flat /= ctx.world_size
    manager.allreduce(flat).wait()
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
        p.grad = g


def pad_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def die(args, ctx, step: int, at: float) -> None:
    """The planned failure: SIGKILL in the middle of the step (no exception, no clean-up, as a
    crashed host), after saying when, so that the driver can time the recovery."""
    pad_until(at)
    dist.report(killed={"step": step, "time": time.time()})
    print(f"group {args.group}: killing myself with SIGKILL in step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def checksum(model) -> str:
    """sha256 of every parameter's bytes: equal only if the weights are bit for bit equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(args, ctx, manager, model, opt, healed: dict) -> tuple[list, list]:
    """Commit --steps steps; returns (records of committed steps, records of failed tries).

    A step, as torchft wants it: start the quorum (asynchronously: the lighthouse answers while
    the model computes), forward and backward on this group's share of the step's batch, pad
    to --step-seconds, average the gradient (`average_gradients`), then should_commit(): the
    optimizer steps only if every group of the quorum says yes, and a failed step is done
    again with the next quorum. A group that joins late heals inside should_commit(): its
    first quorum finds peers ahead of it, and it loads their state (model, optimizer, step)
    over torchft's checkpoint transport (HTTP) before it steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    where = share(args, ctx)
    done, failed = [], []
    # seconds from the padding's end to the commit (all-reduce, votes): the median of the
    # last few steps', so that a step lasts --step-seconds in all, and one slow step (a
    # failure, a heal) stays slow instead of shortening the next ones
    tails = collections.deque([0.0], maxlen=5)
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        t0 = time.time()
        manager.start_quorum()
        opt.zero_grad()
        ids = fsdp_lm.batch(args, step, where)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == args.kill_at and ctx.rank == 0:
            die(args, ctx, step, t0 + args.step_seconds / 2)
        pad_until(t0 + args.step_seconds - statistics.median(tails))
        padded = time.time()
        average_gradients(manager, params, ctx)
        before = healed.get("from")
        if manager.should_commit():   # a healing group loads its peer's state in here
            opt.step()
            now = time.time()
            tails.append(min(now - padded, args.step_seconds / 2))
            done.append({"step": manager.current_step(), "start": t0, "end": now,
                         "participants": manager.num_participants(), "loss": loss.item(),
                         "healed": healed.get("from") != before})
            if ctx.rank == 0:
                log_step(args, done[-1])
            if args.rejoin and len(done) == 1 and not done[0]["healed"]:
                raise RuntimeError(
                    f"group {args.group} was restarted to rejoin, but its first quorum held no "
                    "peer ahead of it to heal from (the other groups had finished or died)")
        else:
            failed.append({"step": step, "start": t0, "end": time.time(),
                           "error": str(manager.errored()).splitlines()[0][:200]})
        if ctx.rank == 0:
            dist.report(steps=done, failures=failed)
    return done, failed


def record_pid(run_dir: str) -> None:
    """This rank's pid and start time, for the driver: a rank forked from the warm pool keeps
    the pool's environment in /proc, so the run's variable does not find it there."""
    from labkit.runtime.guard import start_time
    with open(os.path.join(run_dir, f"pid{os.getpid()}"), "w") as f:
        f.write(start_time(os.getpid()) or "")


def main(argv=None) -> None:
    args = parse_args(argv)
    # torch's loader of the checkpoint a healing group receives (torchft's HTTP transport)
    # warns that the bytes it wraps are read-only: they are never written, only copied
    warnings.filterwarnings("ignore", message="The given buffer is not writable",
                            category=UserWarning)
    ctx = dist.setup("gloo", seed=args.seed)
    if args.run_dir:      # the driver's clean-up finds every rank by this (labs.ft.lab.stop_all)
        record_pid(args.run_dir)
    if args.global_batch % (args.groups * ctx.world_size):
        raise ValueError(f"--global-batch {args.global_batch} does not split over {args.groups} "
                         f"groups of {ctx.world_size} ranks; allowed: a multiple of "
                         f"{args.groups * ctx.world_size}")
    model = fsdp_lm.build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    healed: dict = {}
    manager = make_manager(args, model, opt, healed)
    wait_for_groups(args, ctx)
    done, failed = train(args, ctx, manager, model, opt, healed)
    if ctx.rank == 0:
        dist.report(steps=done, failures=failed, group=args.group, checksum=checksum(model),
                    healed_from=healed.get("from"))
        last = done[-1] if done else None
        print(f"group {args.group}: {len(done)} steps committed, {len(failed)} failed"
              + (f"; last loss {last['loss']:.4f}" if last else ""), flush=True)
    manager.shutdown(wait=False)
    dist.shutdown()


if __name__ == "__main__":
    main()
