"""Data parallelism (DDP) as numbers: step time, scaling, stragglers, sampler, accumulation.

    >>> r = ddp_step_time("llama2-7b", 8, "nvlink4", compute_seconds=1.0)
    >>> r.compute, r.communication, r.exposed, r.total, r.ratio      # seconds; compute / comm
    >>> scaling_curve("llama2-7b", 1024, "ib-ndr", compute_seconds=1.0).stops_scaling
    >>> throughput_loss(0.4)                                         # 0.2857..., not 0.4
    >>> distributed_sampler_indices(10, 4, rank=3)                   # [3, 7, 1]

The models, after Li et al. 2020 ("PyTorch Distributed", VLDB, §3.2): `ddp_step_time` (buckets,
overlap) and `scaling_curve` (weak and strong scaling). Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
import math
import numbers

from labkit import validate
from labkit.comm import ALGORITHMS, Collective, StepComm, collective_time, step_communication
from labkit.hardware import get_gpu, get_link
from labkit.precision import FORMATS

MiB = 2**20
BACKWARD_FRACTION = 2 / 3      # of forward + backward compute: 4N of 6N FLOPs per token
THRESHOLD = 0.8                # efficiency below which `scaling_curve` says DDP stopped scaling
SCALING = ("weak", "strong")
MAX_CURVE_POINTS = 10**4
# Bounds on the compute inputs, far beyond real runs, so that every time stays a readable number:
MAX_STEP_SECONDS = 1e7         # a step of 116 days
MAX_STEP_FLOPS = 1e27          # 32,000 years of one H100 at its dense bf16 peak
MIN_MFU = 1e-3


# ---- step time -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DDPStepTime:
    """One GPU's DDP step, in seconds (bytes where named)."""

    gpus: int
    compute: float            # forward + backward of this GPU's batch
    backward: float           # the backward part of `compute`
    communication: float      # every bucket's all-reduce, back to back
    exposed: float            # communication still running after the backward ended
    latency_time: float       # the alpha part of `communication`: buckets x 2(N-1) alpha (ring)
    gradient_bytes: float     # G: payload of all buckets
    buckets: int              # k all-reduces per backward
    bucket_bytes: float       # size of each full bucket (the last holds the rest)
    bytes_sent: float         # per GPU, ring all-reduce: 2(N-1)/N x G

    @property
    def hidden(self) -> float:
        """Communication that ran during the backward."""
        return self.communication - self.exposed

    @property
    def total(self) -> float:
        return self.compute + self.exposed

    @property
    def ratio(self) -> float:
        """Compute-to-communication ratio (inf with no communication: one GPU)."""
        return self.compute / self.communication if self.communication > 0 else math.inf

    @property
    def efficiency(self) -> float:
        """compute / total: the share of the step this GPU spends computing."""
        return self.compute / self.total


def _gradients(model, gpus: int, grad_bytes) -> StepComm:
    """The gradient all-reduce of one backward, as `step_communication("ddp")` counts it."""
    if isinstance(grad_bytes, str):
        validate.choice("grad_bytes", grad_bytes, FORMATS)
        grad_bytes = FORMATS[grad_bytes].bits / 8
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        psi = validate.positive("model (parameter count)", model, validate.MAX_PARAMS)
        return step_communication("ddp", num_params=psi, dp=gpus, grad_bytes=grad_bytes)
    return step_communication("ddp", model=model, dp=gpus, grad_bytes=grad_bytes)


def buckets(nbytes: float, bucket_size_mb: float) -> tuple[int, float, float]:
    """(k, full, last): `nbytes` of gradients in k = ceil(nbytes / C) buckets of C =
    bucket_size_mb MiB, k - 1 full ones and the last holding the rest (C if it divides)."""
    G = validate.positive("nbytes", nbytes, validate.MAX_BYTES)
    C = validate.at_least("bucket_size_mb", bucket_size_mb, 1 / MiB, validate.MAX_BYTES / MiB) * MiB
    k = max(1, math.ceil(G / C))
    return k, min(C, G), G - (k - 1) * C


def compute_time(compute_seconds=None, flops=None, gpu=None, mfu=None, dtype="bf16") -> float:
    """Seconds of one GPU's forward + backward: `compute_seconds` as given, or `flops` (that
    GPU's FLOPs per step, e.g. `labkit.flops.flops_per_step(model, per_gpu_batch, seq_len)`) /
    (the dense peak of `gpu` (a `labkit.hardware.GPUS` key) in `dtype` x `mfu`)."""
    if (compute_seconds is None) == (flops is None):
        raise ValueError("give compute_seconds= (seconds of one GPU's forward + backward) or "
                         "flops= with gpu= and mfu=, not both and not neither")
    if compute_seconds is not None:
        return validate.positive("compute_seconds", compute_seconds, MAX_STEP_SECONDS)
    if gpu is None or mfu is None:
        raise ValueError("flops= needs gpu= (a labkit.hardware.GPUS key) and mfu= (the share "
                         f"of the GPU's peak achieved, a number from {MIN_MFU:g} to 1, e.g. 0.4)")
    f = validate.positive("flops", flops, MAX_STEP_FLOPS)
    share = validate.at_least("mfu", mfu, MIN_MFU, 1.0)
    rate = get_gpu(gpu).flops(dtype) * share
    if f / rate > MAX_STEP_SECONDS:
        raise ValueError(f"flops={validate.show(f)} at mfu={share:g} of {get_gpu(gpu).name}'s "
                         f"{validate.show(get_gpu(gpu).flops(dtype))} FLOP/s ({dtype}) take "
                         f"{validate.show(f / rate)} s; allowed: a step of at most "
                         f"{validate.show(MAX_STEP_SECONDS)} s")
    return f / rate


def _link(link, bandwidth, latency) -> tuple[float, float]:
    if link is None and bandwidth is None:
        raise ValueError("give link= (a labkit.hardware.LINKS key) or bandwidth= (bytes/s per "
                         "direction, with latency= in seconds)")
    preset = None if link is None else get_link(link)
    bw = preset.bandwidth if bandwidth is None else bandwidth
    lat = (0.0 if preset is None else preset.latency) if latency is None else latency
    return bw, lat


def ddp_step_time(model, gpus, link="nvlink4", *, compute_seconds=None, flops=None, gpu=None,
                  mfu=None, dtype="bf16", grad_bytes=4, bucket_size_mb=25.0, overlap=1.0,
                  backward_fraction=BACKWARD_FRACTION, bandwidth=None, latency=None,
                  algorithm="ring") -> DDPStepTime:
    """One GPU's DDP step: compute + exposed communication (the model: below).

    model: a parameter count, a preset name (`labkit.models.PRESETS`) or a ModelSpec; every
        parameter's gradient is all-reduced. gpus: data-parallel ranks N.
    link: a `labkit.hardware.LINKS` key (or Link); `bandwidth` (bytes/s per direction) and
        `latency` (s) override its figures, or replace it with link=None.
    compute_seconds, or flops + gpu + mfu (+ dtype): see `compute_time`.
    grad_bytes: bytes per gradient value (4: fp32, what torch DDP reduces under autocast, where
        parameters stay fp32), or a format name from `labkit.precision.FORMATS` ("bf16").
    bucket_size_mb (MiB, as torch's bucket_cap_mb), overlap (0-1), backward_fraction (0-1].

    One GPU's step = its forward + backward (`compute`) + the part of the gradient all-reduce
    the backward could not hide (`exposed`):
    - Gradient bytes G = Psi x grad_bytes, Psi the parameters (`labkit.comm.step_communication
      ("ddp")`, the same prediction the labs measure). PyTorch DDP reduces them in buckets of
      `bucket_cap_mb` MiB (2^20 bytes; torch's `_MB_TO_BYTES = 1024 * 1024`): here
      k = ceil(G / C) buckets of C = bucket_size_mb x 2^20 bytes, the last one holding the
      rest. (torch closes a bucket at a parameter boundary, so a tensor larger than C fills
      one alone, and with bucket_cap_mb=None makes its first one 1 MiB; neither is modelled:
      `labkit.quiz.answers_ddp.torch_rule_buckets` counts torch's own rule.)
    - Each bucket is one ring all-reduce, `labkit.comm.collective_time("all_reduce", ...)` =
      2(N-1) alpha + 2(N-1)/N x bytes / B: the latency term 2(N-1) alpha is paid once per
      bucket, so small buckets cost more in all (Li et al. 2020, "PyTorch Distributed:
      Experiences on Accelerating Data Parallel Training", VLDB, §3.2.2 and the bucket-size
      experiments of §5). `communication` is the sum of the k all-reduces run back to back.
    - Overlap (Li et al. 2020, §3.2.3): the backward takes T_b = backward_fraction x compute
      (default 2/3: a backward costs two forwards, 4N of the 6N FLOPs per token, Kaplan et al.
      2020, §2.1). Gradients are taken to become ready at a steady rate over the backward, so
      bucket j < k is ready at r_j = T_b j C / G and the last at T_b. The all-reduces run one
      after another (one communication stream) and none starts before w = (1 - overlap) T_b:
      `overlap` is the share of the backward, at its end, that communication can run beside
      (0: communication starts when the backward ends, as in NaiveDDP; 1: all of it). Bucket j
      starts at max(r_j, w, end of bucket j - 1); the last one ends at E = max over j of
      (max(r_j, w) + c_j + ... + c_k) (the end of a first-come-first-served queue), and
      `exposed` = E - T_b. The last bucket is ready only when the backward ends, so its
      all-reduce is never hidden: exposed >= c_k.
    - total = compute + exposed; ratio = compute / communication (inf on one GPU).
    """
    n = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    f = validate.non_negative("overlap", overlap, 1.0)
    t = compute_time(compute_seconds, flops, gpu, mfu, dtype)
    tb = t * validate.positive("backward_fraction", backward_fraction, 1.0)
    bw, lat = _link(link, bandwidth, latency)
    validate.choice("algorithm", algorithm, ALGORITHMS)
    grads = _gradients(model, n, grad_bytes)
    G = grads.total_payload
    k, full, last = buckets(G, bucket_size_mb)

    def allreduce(nbytes, alpha=lat):
        return collective_time("all_reduce", nbytes, n, bw, alpha, algorithm)

    c_full, c_last = allreduce(full), allreduce(last)
    communication = (k - 1) * c_full + c_last
    # E - T_b over the buckets that can start a busy period: the last (ready at T_b), and,
    # with full buckets, the first and the last full one (max(r_j, w) + the rest is the larger
    # of a function linear in j and one falling with j: its maximum is at an end)
    late = [c_last]
    for j in {1, k - 1} - {0, k}:
        start = max(tb * j * full / G - tb, -f * tb)          # max(r_j, w) - T_b <= 0
        late.append(start + (k - j) * c_full + c_last)
    return DDPStepTime(gpus=n, compute=t, backward=tb, communication=communication,
                       exposed=max(late), latency_time=k * allreduce(0.0),
                       gradient_bytes=G, buckets=k, bucket_bytes=full,
                       bytes_sent=grads.total_bytes)


# ---- scaling ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScalingPoint:
    gpus: int
    step: DDPStepTime
    throughput: float         # batches (of `batch`) per second, all GPUs together
    efficiency: float         # throughput / (gpus x throughput on one GPU)

    @property
    def speedup(self) -> float:
        return self.gpus * self.efficiency


@dataclass(frozen=True)
class ScalingCurve:
    scaling: str              # "weak" | "strong"
    threshold: float
    points: tuple
    one_gpu_throughput: float  # batches per second with all the work on one GPU

    def ideal(self, gpus: int) -> float:
        """Throughput if N GPUs went N times as fast as one."""
        return gpus * self.one_gpu_throughput

    @property
    def gpus(self) -> list[int]:
        return [p.gpus for p in self.points]

    @property
    def stops_scaling(self) -> int | None:
        """The fewest GPUs whose efficiency is below the threshold (None: none in the curve)."""
        return next((p.gpus for p in self.points if p.efficiency < self.threshold), None)

    @property
    def best(self) -> ScalingPoint:
        """The point of highest throughput (the fewest GPUs on a tie)."""
        return max(self.points, key=lambda p: (p.throughput, -p.gpus))


def gpu_counts(gpus) -> list[int]:
    """The GPU counts of a curve: for a number N, 1, 2, 4, ... up to N, and N; else the counts
    given (sorted, each once)."""
    if isinstance(gpus, numbers.Real) and not isinstance(gpus, bool):
        top = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
        return sorted({2**i for i in range(top.bit_length())} | {top})
    counts = sorted({validate.positive_int("gpus", g, validate.MAX_RANKS) for g in gpus})
    if not 1 <= len(counts) <= MAX_CURVE_POINTS:
        raise ValueError(f"gpus has {len(counts):,} distinct counts; allowed: 1 to "
                         f"{MAX_CURVE_POINTS:,}")
    return counts


def scaling_curve(model, gpus, link="nvlink4", *, scaling="weak", batch=1.0, at_gpus=1,
                  threshold=THRESHOLD, compute_seconds=None, flops=None, gpu=None, mfu=None,
                  dtype="bf16", **step) -> ScalingCurve:
    """`ddp_step_time` on each GPU count of `gpu_counts(gpus)`.

    scaling="weak": compute_seconds (or flops) is one GPU's work per step, the same at every N;
    `batch` is each GPU's batch (throughput = N x batch / total). scaling="strong": a global
    batch of `batch` split over N GPUs; compute_seconds (or flops) is one GPU's work when it is
    split over `at_gpus` GPUs (1: all of it), so N GPUs do compute x at_gpus / N each
    (throughput = batch / total). `step`: the other keywords of `ddp_step_time` (grad_bytes,
    bucket_size_mb, overlap, ...).

    Throughput and efficiency = throughput(N) / (N x throughput(1)) over N GPUs; "weak" keeps
    each GPU's batch (and compute) fixed, "strong" splits a fixed global batch (each GPU
    computes 1/N of it). Both give efficiency = compute(N) / total(N). DDP stops scaling at the
    first N whose efficiency is below `threshold`.
    """
    validate.choice("scaling", scaling, SCALING)
    b = validate.positive("batch", batch)
    at = validate.positive_int("at_gpus", at_gpus, validate.MAX_RANKS)
    limit = validate.positive("threshold", threshold, 1.0)
    given = compute_time(compute_seconds, flops, gpu, mfu, dtype)
    one = given if scaling == "weak" else given * at       # the work of a step on one GPU
    single = b / one                                       # its throughput
    points = []
    for n in gpu_counts(gpus):
        work = one if scaling == "weak" else one / n
        r = ddp_step_time(model, n, link, compute_seconds=work, **step)
        throughput = (n * b if scaling == "weak" else b) / r.total
        points.append(ScalingPoint(n, r, throughput, throughput / (n * single)))
    return ScalingCurve(scaling, limit, tuple(points), single)


# ---- stragglers ------------------------------------------------------------------------------

def throughput_loss(step_time_increase) -> float:
    """Share of throughput lost when the step takes (1 + x) times as long: 1 - 1/(1 + x).
    A 40% longer step (x = 0.4) loses 28.6% of the throughput, not 40%."""
    x = validate.non_negative("step_time_increase", step_time_increase)
    return x / (1 + x)


@dataclass(frozen=True)
class Straggler:
    step_time: float          # every rank's step: the slowest rank's work
    slowest_rank: int
    baseline: float           # the step without the straggler
    waiting: tuple            # per rank: seconds spent waiting for the slowest

    @property
    def increase(self) -> float:
        return self.step_time / self.baseline - 1

    @property
    def throughput_loss(self) -> float:
        return throughput_loss(max(0.0, self.increase))


def straggler(rank_seconds, baseline=None) -> Straggler:
    """A synchronous step takes as long as its slowest rank: given each rank's own work per step
    (seconds, without waiting), every rank's step time is the maximum. `baseline`: the step time
    without the straggler (default: the median rank's work, the lower middle one for an even
    count); a step no longer than the baseline loses nothing (throughput_loss 0)."""
    try:
        times = list(rank_seconds)
    except TypeError:
        raise ValueError(f"rank_seconds={validate.describe(rank_seconds)} must be a list of "
                         "seconds, one per rank") from None
    if not 1 <= len(times) <= validate.MAX_RANKS:
        raise ValueError(f"rank_seconds has {len(times):,} values; give one per rank (at least 1)")
    times = [validate.positive(f"rank_seconds[{i}]", t) for i, t in enumerate(times)]
    slow = max(times)
    base = (sorted(times)[(len(times) - 1) // 2] if baseline is None
            else validate.positive("baseline", baseline))
    return Straggler(slow, times.index(slow), base, tuple(slow - t for t in times))


# ---- DistributedSampler ----------------------------------------------------------------------

def sampler_num_samples(dataset_len, num_replicas, drop_last=False) -> int:
    """Samples each rank gets from torch's DistributedSampler: ceil(len / R), or with drop_last
    (and R not dividing len) floor(len / R), torch's ceil((len - R) / R)."""
    L = validate.positive_int("dataset_len", dataset_len, validate.MAX_BATCH)
    R = validate.positive_int("num_replicas", num_replicas, validate.MAX_RANKS)
    validate.choice("drop_last", drop_last, (False, True))
    return L // R if drop_last else -(-L // R)


def distributed_sampler_indices(dataset_len, num_replicas, rank, drop_last=False) -> list[int]:
    """The indices rank `rank` iterates, as `torch.utils.data.DistributedSampler(dataset,
    num_replicas, rank, shuffle=False, drop_last=drop_last)` yields them.

    torch lists range(len), pads it to num_samples x R by repeating it from the start (not
    drop_last) or cuts it there (drop_last), and gives rank r every R-th index from r: the j-th
    index of rank r is (r + j R) mod len (torch/utils/data/distributed.py, `__init__` and
    `__iter__`). With shuffle=True the list is first permuted by
    torch.randperm seeded with seed + epoch (`set_epoch`): that needs torch (the lab shows it)."""
    n = sampler_num_samples(dataset_len, num_replicas, drop_last)
    R = int(num_replicas)
    if not (isinstance(rank, numbers.Integral) and not isinstance(rank, bool) and 0 <= rank < R):
        raise ValueError(f"rank={validate.describe(rank)} must be a whole number from 0 to "
                         f"{R - 1} (num_replicas={R})")
    return [(rank + j * R) % int(dataset_len) for j in range(n)]


# ---- gradient accumulation -------------------------------------------------------------------

def accumulation_communication(model, gpus, microbatches, *, no_sync=True, grad_bytes=4,
                               bucket_size_mb=None) -> StepComm:
    """All-reduces of one optimizer step of DDP over `microbatches` backward passes.

    DDP all-reduces the gradients at the end of every backward unless it runs inside
    `no_sync()`: a plain loop sends the gradients `microbatches` times; with no_sync around all
    but the last backward, once. bucket_size_mb=None counts one all-reduce of all gradients per
    synchronised backward; a size splits each into `buckets(G, bucket_size_mb)` (the bytes are
    the same). Li et al. 2020, §3.2.4 (gradient accumulation and no_sync). `.by_op`,
    `.total_payload`, `.total_bytes` and `.time(bandwidth, latency)` as for
    `labkit.comm.StepComm`."""
    n = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    m = validate.positive_int("microbatches", microbatches, validate.MAX_BATCH)
    validate.choice("no_sync", no_sync, (False, True))
    G = _gradients(model, n, grad_bytes).total_payload
    k, full, last = (1, G, G) if bucket_size_mb is None else buckets(G, bucket_size_mb)
    syncs = 1 if no_sync else m
    out = StepComm("ddp", notes=f"{m} micro-batch(es), {'with' if no_sync else 'without'} "
                                f"no_sync: {syncs} synchronised backward(s) x {k} bucket(s)")
    if k > 1:
        out.collectives.append(Collective("all_reduce", syncs * (k - 1), full, n, "full buckets"))
    out.collectives.append(Collective("all_reduce", syncs, last, n,
                                      "last bucket" if k > 1 else "gradients"))
    return out


def effective_batch(micro_batch, microbatches, gpus) -> int:
    """Samples per optimizer step: micro-batch x micro-batches x data-parallel GPUs."""
    return (validate.positive_int("micro_batch", micro_batch, validate.MAX_BATCH)
            * validate.positive_int("microbatches", microbatches, validate.MAX_BATCH)
            * validate.positive_int("gpus", gpus, validate.MAX_RANKS))
