"""Checkpointing at scale: how big a checkpoint is, how long it takes to write, how often a job
fails, and how often to checkpoint.

    >>> size = checkpoint_bytes("llama3-70b")                 # fp32 master + AdamW: 12 B/param
    >>> t = write_seconds(size, 100e9)                         # at 100 GB/s aggregate
    >>> mtbf = job_mtbf(gpus=16_000, daily_failure_rate=1e-4)  # seconds between failures
    >>> young_daly_interval(mtbf, t), overhead(young_daly_interval(mtbf, t), t, mtbf)

Sources: torch.distributed.checkpoint (what DCP saves), J. W. Young, CACM 17(9), 1974, and
J. T. Daly, FGCS 22(3), 2006 (the interval, to higher order); each formula is in its function.
Pure Python.
"""
from __future__ import annotations

import math
import numbers

from labkit import validate
from labkit.models import get_model

DAY = 86_400.0
KINDS = {"training": 12, "export": 2}     # bytes per parameter: fp32 + AdamW; bf16 weights
MAX_SECONDS = 1e12                        # ~30,000 years: beyond any job
# Measured (A. Grattafiori et al., "The Llama 3 Herd of Models", 2024, section 3.3.4): 419
# unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = {"interruptions": 419, "days": 54, "gpus": 16_384}


def checkpoint_bytes(model, kind: str = "training") -> float:
    """Bytes of one checkpoint of `model` (a preset name, ModelSpec, transformers config or a
    parameter count): kind "training" 12 B/param (fp32 weights + AdamW's two fp32 moments, what
    DCP saves for FSDP2 + AdamW), "export" 2 B/param (bf16 weights only).

    "training" is what `torch.distributed.checkpoint` (DCP) saves for a run with FSDP2's fp32
    sharded parameters and AdamW: the fp32 weights (4 B/param, the master copy) and the two
    fp32 moments (8 B/param); AdamW's per-tensor `step` counters are a few bytes, not counted.
    "export" is for inference."""
    validate.choice("kind", kind, KINDS)
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        n = validate.positive("model (parameter count)", model, validate.MAX_PARAMS)
    else:
        n = get_model(model).num_params()
    return float(KINDS[kind] * n)


def write_seconds(nbytes, bandwidth, *, nodes: int = 1, per_node: bool = False) -> float:
    """Seconds to write `nbytes` at `bandwidth` bytes/s: the storage's aggregate bandwidth
    (per_node=False; the nodes share it), or each node's own (per_node=True: `nodes` nodes write
    their shards in parallel, nodes x bandwidth in all)."""
    size = validate.positive("nbytes", nbytes, validate.MAX_BYTES)
    bw = validate.at_least("bandwidth", bandwidth, validate.MIN_BANDWIDTH, validate.MAX_BYTES)
    n = validate.positive_int("nodes", nodes, validate.MAX_RANKS)
    validate.choice("per_node", per_node, (False, True))
    return size / (bw * (n if per_node else 1))


def failures_per_day(gpus: int, daily_failure_rate: float) -> float:
    """Expected failures a day of a job on `gpus` GPUs, each failing with probability
    `daily_failure_rate` a day (a fraction: 0.01 % is 1e-4), independently."""
    g = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    r = validate.positive("daily_failure_rate", daily_failure_rate, 1.0)
    return g * r


def measured_failure_rate(interruptions: int, days: float, gpus: int) -> float:
    """The failure rate per GPU per day (a fraction) that `interruptions` over `days` on `gpus`
    GPUs imply: interruptions / (days x gpus). Llama 3's 419 in 54 days on 16,384 GPUs is
    4.74e-4, about 0.047 %/GPU/day (every unexpected interruption counted as one GPU's)."""
    n = validate.positive("interruptions", interruptions, 1e12)
    d = validate.positive("days", days, 1e6)
    g = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    return n / (d * g)


LLAMA3_FAILURE_RATE = measured_failure_rate(**LLAMA3_INTERRUPTIONS)


def job_mtbf(gpus: int, daily_failure_rate: float) -> float:
    """Mean time between failures of the whole job, in seconds: one day / (gpus x rate).

    A job of G GPUs, each failing at r per day independently, fails G x r times a day; its MTBF
    is 1 / (G r) days. 0.01 %/GPU/day on 1,000 GPUs is 0.1 failures a day, one every 10 days
    (not "every 10 hours"); on 16,000 GPUs, 1.6 a day, one every 15 hours."""
    return DAY / failures_per_day(gpus, daily_failure_rate)


def young_daly_interval(mtbf, write_time, order: int = 1) -> float:
    """The checkpoint interval (seconds of work between checkpoints) that minimises the time
    lost, for write_time delta and mtbf M. Order 1, Young (1974): sqrt(2 delta M). Order 2,
    Daly's higher-order estimate (2006): sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) +
    (1/9) (delta / 2M)] - delta while delta < 2M, and M once delta >= 2M. Daly's own figures
    at delta = 5 min: M = 24 h, 117 min; M = 6 h, 57 min; M = 15 min, 9.1 min.

    J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9), 1974; J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006,
    doi:10.1016/j.future.2004.11.016."""
    m = validate.positive("mtbf", mtbf, MAX_SECONDS)
    d = validate.positive("write_time", write_time, MAX_SECONDS)
    validate.choice("order", order, (1, 2))
    tau = math.sqrt(2 * d * m)
    if order == 1:
        return tau
    if d >= 2 * m:                       # writing takes longer than two MTBFs: Daly's tau = M
        return m
    x = d / (2 * m)
    return tau * (1 + math.sqrt(x) / 3 + x / 9) - d


def restart_lost_seconds(since_checkpoint, restart_seconds) -> float:
    """Wall time one failure costs a job that restarts from its last checkpoint: the work done
    since that checkpoint, lost and done again, plus the restart (notice the failure, stop
    and start the processes, rendezvous, load the checkpoint):

        lost = since_checkpoint + restart_seconds

    Nothing else is lost: the steps before the checkpoint are not redone, and the rest of the
    run takes as long as it would have. labkit.labs.elastic measures both terms (its steps
    padded to a fixed time, so that the work since the checkpoint is known in seconds)."""
    since = validate.non_negative("since_checkpoint", since_checkpoint, MAX_SECONDS)
    restart = validate.non_negative("restart_seconds", restart_seconds, MAX_SECONDS)
    return since + restart


def expected_lost_seconds(interval, restart_seconds) -> float:
    """Expected wall time one failure costs at checkpoint `interval` (seconds of work between
    checkpoints), a failure striking at a uniformly random moment of an interval:

        E[lost] = interval / 2 + restart_seconds

    Times the failures of a run (run time / MTBF) this is the work-lost and restart terms of
    `overhead`; at Young's interval sqrt(2 write_time mtbf) it is sqrt(write_time mtbf / 2) +
    restart_seconds."""
    tau = validate.positive("interval", interval, MAX_SECONDS)
    return restart_lost_seconds(tau / 2, restart_seconds)


def goodput(work_seconds, lost_seconds=0.0, write_seconds=0.0) -> float:
    """The fraction of wall time that trained: work / (work + checkpoint writes + time lost to
    failures), for a run of `work_seconds` of useful steps that spent `write_seconds` writing
    checkpoints (outside the steps) and lost `lost_seconds` (restart_lost_seconds, summed over
    its failures). 1.0 is a run that never stopped."""
    work = validate.positive("work_seconds", work_seconds, MAX_SECONDS)
    lost = validate.non_negative("lost_seconds", lost_seconds, MAX_SECONDS)
    write = validate.non_negative("write_seconds", write_seconds, MAX_SECONDS)
    return work / (work + write + lost)


def overhead(interval, write_time, mtbf, restart_seconds=0.0) -> float:
    """Expected fraction of time lost at checkpoint `interval` (first order): writing,
    write_time / interval, plus the work lost per failure, half an interval, interval /
    (2 mtbf), plus restart_seconds / mtbf. At Young's interval the first two terms are equal
    and the overhead is sqrt(2 write_time / mtbf)."""
    tau = validate.positive("interval", interval, MAX_SECONDS)
    d = validate.non_negative("write_time", write_time, MAX_SECONDS)
    m = validate.positive("mtbf", mtbf, MAX_SECONDS)
    r = validate.non_negative("restart_seconds", restart_seconds, MAX_SECONDS)
    return d / tau + tau / (2 * m) + r / m


FT_COUNTS = ("samples", "steps")


def ft_lost_seconds(downtime, groups, step_seconds, *, detect_seconds=0.0, heal_seconds=0.0,
                    count: str = "samples") -> float:
    """Expected seconds of training lost to one failure of one of R = `groups` replica groups
    when the others carry on (torchft): nothing rolls back, the failed group restarts and heals
    from a peer's memory. Measured by labkit.labs.ft.

    From the failure, mid-step on average (step = step_seconds, D = downtime: from the failure
    to the restarted group's first committed step):
    - the step in flight fails at its all-reduce and is done again. torchft forms the next
      quorum while a step computes, so the redo overlaps the lighthouse's detection (detect:
      from the failure until it forms a quorum without the dead group, about its heartbeat
      timeout): the step commits max(1.5 step, detect) after the failure instead of step/2
      after it, max(step, detect - step/2) late;
    - when the group rejoins, the quorum is formed again and it fetches a peer's state: heal
      seconds in which no step commits;
    - from the redone step to the rejoined group's first step, steps commit at full speed on
      (R - 1)/R of the global batch: (D - max(1.5 step, detect) - heal)/step + 1 steps lose
      1/R of their samples each.

        "steps":   max(step, detect - step/2) + heal        (the job's step count goes on)
        "samples": that + max(step, D + step - max(1.5 step, detect) - heal) / R

    With R = 8 groups, 2 s steps, torchft's 5 s heartbeat timeout, a 10 s heal and a 10 min
    restart: 14 s of steps and 14 + 587/8 = 87 s of samples, where restarting the whole job
    from a checkpoint loses the 10 min and the work since the checkpoint
    (`restart_lost_seconds`). Assumes
    one group down at a time (failures far apart), steps of equal length, and that a step
    trains the groups' shares of one global batch; the whole job failing (the lighthouse,
    every group) still needs checkpoints."""
    step = validate.positive("step_seconds", step_seconds, MAX_SECONDS)
    r = validate.positive_int("groups", groups, validate.MAX_RANKS)
    if r < 2:
        raise ValueError(f"groups={r}: with one replica group nobody carries on; allowed: "
                         "groups >= 2")
    detect = validate.non_negative("detect_seconds", detect_seconds, MAX_SECONDS)
    heal = validate.non_negative("heal_seconds", heal_seconds, MAX_SECONDS)
    validate.choice("count", count, FT_COUNTS)
    d = validate.positive("downtime", downtime, MAX_SECONDS)
    steps = max(step, detect - step / 2) + heal
    if count == "steps":
        return steps
    return steps + max(step, d + step - max(1.5 * step, detect) - heal) / r


def ft_overhead(mtbf, downtime, groups, step_seconds, *, detect_seconds=0.0,
                heal_seconds=0.0) -> float:
    """Expected fraction of training lost to failures with torchft, one every `mtbf` seconds:
    ft_lost_seconds(..., count="samples") / mtbf. The counterpart of `overhead` at Young's
    interval for checkpoint/restart (which loses write_time / interval + interval / (2 mtbf) +
    restart / mtbf). Needs mtbf >= downtime: one group down at a time."""
    m = validate.positive("mtbf", mtbf, MAX_SECONDS)
    d = validate.positive("downtime", downtime, MAX_SECONDS)
    if m < d:
        raise ValueError(f"mtbf={validate.describe(m)} is shorter than downtime="
                         f"{validate.describe(d)}: failures would overlap, which this "
                         "model does not cover; allowed: mtbf >= downtime")
    return ft_lost_seconds(d, groups, step_seconds, detect_seconds=detect_seconds,
                           heal_seconds=heal_seconds) / m
