"""labkit.scaling, the DDP cost model: hand-computed steps, the bucket queue against a plain
event-by-event simulation, properties, DistributedSampler against torch's, and bad input."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from labkit import scaling as sc
from labkit.comm import collective_time
from labkit.hardware import GPUS, LINKS
from labkit.models import get_model

FAST = settings(max_examples=60, deadline=None)
MiB = 2**20
# A link on which a 25 MiB bucket takes 0.1 s on 2 GPUs (2(N-1)/N = 1) plus 2 alpha = 2 ms.
B = 25 * MiB / 0.1
LINK = dict(link=None, bandwidth=B, latency=1e-3)


def simulate(params, gpus, compute, bandwidth, latency, bucket_mb, overlap, grad_bytes=4,
             backward_fraction=2 / 3):
    """The bucket queue, one event at a time: bucket j ready when the backward has produced its
    bytes, started when it is ready, the link free, and the overlap window open."""
    G = params * grad_bytes
    C = bucket_mb * MiB
    sizes = []
    while sum(sizes) < G:
        sizes.append(min(C, G - sum(sizes)))
    tb = compute * backward_fraction
    window = (1 - overlap) * tb
    end, done = 0.0, 0.0
    for size in sizes:
        done += size
        ready = tb * done / G
        start = max(ready, window, end)
        end = start + collective_time("all_reduce", size, gpus, bandwidth, latency)
    return max(end - tb, 0.0), sizes


# ---- hand-computed -----------------------------------------------------------------------

@pytest.mark.parametrize("overlap, exposed", [
    # 4 buckets of 25 MiB ready at 0.05, 0.10, 0.15, 0.20 s (backward 0.2 s), 0.102 s each
    (1.0, 0.458 - 0.2),     # queue from 0.05: ends 0.152, 0.254, 0.356, 0.458
    (0.5, 0.508 - 0.2),     # nothing starts before 0.1
    (0.0, 0.408),           # everything after the backward
])
def test_hand_computed_step(overlap, exposed):
    r = sc.ddp_step_time(100 * MiB / 4, 2, compute_seconds=0.3, overlap=overlap, **LINK)
    assert r.buckets == 4 and r.bucket_bytes == 25 * MiB and r.gradient_bytes == 100 * MiB
    assert r.communication == pytest.approx(4 * 0.102)
    assert r.latency_time == pytest.approx(4 * 2e-3)
    assert r.bytes_sent == 100 * MiB                      # 2(N-1)/N = 1 at N = 2
    assert r.exposed == pytest.approx(exposed)
    assert r.total == pytest.approx(0.3 + exposed)
    assert r.ratio == pytest.approx(0.3 / 0.408)
    assert r.hidden == pytest.approx(0.408 - exposed)


def test_a_long_backward_hides_all_but_the_last_bucket():
    r = sc.ddp_step_time(100 * MiB / 4, 2, compute_seconds=3.0, **LINK)   # ready every 0.5 s
    assert r.exposed == pytest.approx(0.102)


def test_last_bucket_holds_the_rest():
    r = sc.ddp_step_time(60 * MiB / 4, 2, compute_seconds=3.0, **LINK)
    assert (r.buckets, r.bucket_bytes) == (3, 25 * MiB)
    assert r.exposed == pytest.approx(collective_time("all_reduce", 10 * MiB, 2, B, 1e-3))
    assert sc.buckets(60 * MiB, 25) == (3, 25 * MiB, 10 * MiB)
    assert sc.buckets(50 * MiB, 25) == (2, 25 * MiB, 25 * MiB)
    assert sc.buckets(1000, 25) == (1, 1000, 1000)


def test_a_preset_all_reduces_every_parameter_in_fp32_by_default():
    for name, gpus in (("gpt2", 4), ("llama2-7b", 8)):
        r = sc.ddp_step_time(name, gpus, "nvlink4", compute_seconds=1.0)
        G = get_model(name).num_params() * 4
        assert r.gradient_bytes == G and r.bytes_sent == pytest.approx(2 * (gpus - 1) / gpus * G)
        assert r.buckets == math.ceil(G / (25 * MiB))
    bf16 = sc.ddp_step_time("gpt2", 4, "nvlink4", compute_seconds=1.0, grad_bytes="bf16")
    assert bf16.gradient_bytes == get_model("gpt2").num_params() * 2


def test_compute_from_flops_gpu_and_mfu():
    peak = GPUS["h100-sxm"].peak_flops["bf16"]
    r = sc.ddp_step_time(1e9, 8, "nvlink4", flops=peak, gpu="h100-sxm", mfu=0.5)
    assert r.compute == pytest.approx(2.0) and r.backward == pytest.approx(4 / 3)
    link = LINKS["nvlink4"]
    assert r.communication == pytest.approx(
        (r.buckets - 1) * collective_time("all_reduce", 25 * MiB, 8, link.bandwidth, link.latency)
        + collective_time("all_reduce", 4e9 - (r.buckets - 1) * 25 * MiB, 8, link.bandwidth,
                          link.latency))


def test_one_gpu_has_no_communication():
    r = sc.ddp_step_time("gpt2", 1, "ib-ndr", compute_seconds=0.5)
    assert r.communication == r.exposed == r.bytes_sent == 0 and r.total == 0.5
    assert r.ratio == math.inf and r.efficiency == 1


# ---- the queue, against the plain simulation ---------------------------------------------

@FAST
@given(params=st.floats(1e3, 2e9), gpus=st.integers(2, 64), compute=st.floats(1e-3, 10),
       bandwidth=st.floats(1e8, 1e12), latency=st.floats(0, 1e-4),
       bucket_mb=st.floats(1, 500), overlap=st.floats(0, 1), fraction=st.floats(0.1, 1))
def test_queue_equals_the_event_by_event_simulation(params, gpus, compute, bandwidth, latency,
                                                    bucket_mb, overlap, fraction):
    want, sizes = simulate(params, gpus, compute, bandwidth, latency, bucket_mb, overlap,
                           backward_fraction=fraction)
    r = sc.ddp_step_time(params, gpus, None, compute_seconds=compute, bandwidth=bandwidth,
                         latency=latency, bucket_size_mb=bucket_mb, overlap=overlap,
                         backward_fraction=fraction)
    assert r.buckets == len(sizes)
    assert r.exposed == pytest.approx(want, rel=1e-9, abs=1e-12)


# ---- properties -------------------------------------------------------------------------------

model = st.sampled_from(["gpt2", "llama2-7b", "debug", 3e8, 7e10])
link = st.sampled_from(list(LINKS))


@FAST
@given(m=model, link=link, bucket=st.floats(1, 200), gpus=st.integers(2, 4096),
       overlap=st.floats(0, 1))
def test_more_gpus_never_less_communication_per_gpu(m, link, bucket, gpus, overlap):
    kw = dict(compute_seconds=1.0, bucket_size_mb=bucket, overlap=overlap)
    a = sc.ddp_step_time(m, gpus, link, **kw)
    b = sc.ddp_step_time(m, gpus + 1, link, **kw)
    assert b.communication >= a.communication and b.bytes_sent >= a.bytes_sent


@FAST
@given(m=model, link=link, gpus=st.integers(1, 1024), bucket=st.floats(1, 200),
       compute=st.floats(1e-3, 10))
def test_no_overlap_exposes_all_communication(m, link, gpus, bucket, compute):
    r = sc.ddp_step_time(m, gpus, link, compute_seconds=compute, bucket_size_mb=bucket,
                         overlap=0)
    assert r.exposed == r.communication and r.total == compute + r.communication


@FAST
@given(m=model, link=link, gpus=st.integers(2, 1024), small=st.floats(0.5, 100),
       factor=st.floats(1, 50))
def test_bigger_buckets_fewer_latency_terms(m, link, gpus, small, factor):
    a = sc.ddp_step_time(m, gpus, link, compute_seconds=1.0, bucket_size_mb=small)
    b = sc.ddp_step_time(m, gpus, link, compute_seconds=1.0, bucket_size_mb=small * factor)
    assert b.buckets <= a.buckets and b.latency_time <= a.latency_time
    assert a.latency_time == pytest.approx(a.buckets * collective_time(
        "all_reduce", 0, gpus, LINKS[link].bandwidth, LINKS[link].latency))


@FAST
@given(m=model, link=link, gpus=st.integers(2, 1024), bucket=st.floats(1, 200),
       lo=st.floats(0, 1), hi=st.floats(0, 1), compute=st.floats(1e-3, 10))
def test_more_overlap_never_exposes_more_and_the_last_bucket_never_hides(m, link, gpus, bucket,
                                                                        lo, hi, compute):
    lo, hi = min(lo, hi), max(lo, hi)
    kw = dict(compute_seconds=compute, bucket_size_mb=bucket)
    a = sc.ddp_step_time(m, gpus, link, overlap=lo, **kw)
    b = sc.ddp_step_time(m, gpus, link, overlap=hi, **kw)
    assert b.exposed <= a.exposed * (1 + 1e-12) and a.exposed <= a.communication
    L = LINKS[link]
    last = a.gradient_bytes - (a.buckets - 1) * a.bucket_bytes
    never_hidden = collective_time("all_reduce", last, gpus, L.bandwidth, L.latency)
    assert b.exposed >= never_hidden * (1 - 1e-12)


# ---- scaling --------------------------------------------------------------------------------

def test_gpu_counts():
    assert sc.gpu_counts(12) == [1, 2, 4, 8, 12] and sc.gpu_counts(1) == [1]
    assert sc.gpu_counts([8, 2, 2, 3]) == [2, 3, 8]


@pytest.mark.parametrize("scaling", sc.SCALING)
def test_scaling_curve_efficiency_and_where_it_stops(scaling):
    c = sc.scaling_curve("llama2-7b", 256, "ib-ndr", compute_seconds=2.0, batch=8,
                         scaling=scaling)
    assert c.gpus == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    one = c.points[0]
    assert one.efficiency == 1 and one.throughput == pytest.approx(8 / 2.0)
    for p in c.points:
        work = 2.0 if scaling == "weak" else 2.0 / p.gpus
        assert p.step.compute == pytest.approx(work)
        assert p.efficiency == pytest.approx(p.step.compute / p.step.total)
        per_step = p.gpus * 8 if scaling == "weak" else 8
        assert p.throughput == pytest.approx(per_step / p.step.total)
    below = [p.gpus for p in c.points if p.efficiency < 0.8]
    assert below and c.stops_scaling == below[0]
    assert c.best.throughput == max(p.throughput for p in c.points)
    if scaling == "strong":        # a fixed batch over ever more GPUs: throughput turns down
        assert c.best.gpus < 256


def test_strong_scaling_from_a_step_measured_on_several_gpus():
    """compute_seconds measured on 8 GPUs sharing the batch is the whole batch's 8 x it."""
    kw = dict(scaling="strong", batch=64, link="ib-hdr")
    a = sc.scaling_curve("gpt2", 32, compute_seconds=0.25, at_gpus=8, **kw)
    b = sc.scaling_curve("gpt2", 32, compute_seconds=2.0, **kw)
    assert [p.step.compute for p in a.points] == pytest.approx([2.0 / n for n in b.gpus])
    assert [p.efficiency for p in a.points] == pytest.approx([p.efficiency for p in b.points])
    assert a.one_gpu_throughput == pytest.approx(64 / 2.0) and a.ideal(4) == pytest.approx(128)


def test_a_fast_link_keeps_scaling():
    c = sc.scaling_curve(1e6, 64, "nvlink5", compute_seconds=1.0)
    assert c.stops_scaling is None and c.best.gpus == 64


# ---- stragglers -------------------------------------------------------------------------------

def test_throughput_loss_is_not_the_step_time_increase():
    assert sc.throughput_loss(0.4) == pytest.approx(1 - 1 / 1.4) == pytest.approx(0.2857, abs=1e-4)
    assert sc.throughput_loss(0) == 0 and sc.throughput_loss(1.0) == pytest.approx(0.5)


def test_every_rank_waits_for_the_straggler():
    s = sc.straggler([1.0, 1.0, 1.4, 1.0])
    assert (s.step_time, s.slowest_rank, s.baseline) == (1.4, 2, 1.0)
    assert s.waiting == pytest.approx((0.4, 0.4, 0.0, 0.4))
    assert s.increase == pytest.approx(0.4) and s.throughput_loss == pytest.approx(0.2857, abs=1e-4)
    assert sc.straggler([1.2, 1.5], baseline=1.0).increase == pytest.approx(0.5)


# ---- DistributedSampler -----------------------------------------------------------------------

def test_sampler_indices_equal_torchs():
    from torch.utils.data import DistributedSampler

    for length in list(range(1, 26)) + [97, 128]:
        for replicas in range(1, 9):
            for drop_last in (False, True):
                for rank in range(replicas):
                    torch_sampler = DistributedSampler(range(length), replicas, rank,
                                                       shuffle=False, drop_last=drop_last)
                    got = sc.distributed_sampler_indices(length, replicas, rank, drop_last)
                    assert got == list(torch_sampler), (length, replicas, rank, drop_last)
                    assert len(got) == len(torch_sampler) == sc.sampler_num_samples(
                        length, replicas, drop_last)


def test_sampler_pads_from_the_start_or_drops_the_tail():
    assert [sc.distributed_sampler_indices(10, 4, r) for r in range(4)] == [
        [0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [sc.distributed_sampler_indices(10, 4, r, drop_last=True) for r in range(4)] == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    assert sc.distributed_sampler_indices(2, 5, 4) == [0]       # padded more than once over


# ---- gradient accumulation ------------------------------------------------------------------

@pytest.mark.parametrize("bucket", [None, 25.0])
def test_no_sync_communicates_once_per_optimizer_step(bucket):
    G = get_model("gpt2").num_params() * 4
    per_backward = 1 if bucket is None else math.ceil(G / (25 * MiB))
    with_ = sc.accumulation_communication("gpt2", 4, 8, no_sync=True, bucket_size_mb=bucket)
    without = sc.accumulation_communication("gpt2", 4, 8, no_sync=False, bucket_size_mb=bucket)
    assert with_.by_op["all_reduce"][0] == per_backward
    assert without.by_op["all_reduce"][0] == 8 * per_backward
    assert with_.total_payload == pytest.approx(G) and without.total_payload == pytest.approx(8 * G)
    assert without.total_bytes == pytest.approx(8 * 2 * 3 / 4 * G)
    one = sc.accumulation_communication("gpt2", 4, 1, no_sync=False, bucket_size_mb=bucket)
    assert one.by_op == sc.accumulation_communication("gpt2", 4, 1, bucket_size_mb=bucket).by_op


def test_effective_batch():
    assert sc.effective_batch(4, 8, 16) == 512


# ---- bad input ------------------------------------------------------------------------------

def step(**kw):
    return sc.ddp_step_time(**{"model": "gpt2", "gpus": 8, "link": "nvlink4",
                               "compute_seconds": 1.0, **kw})


@pytest.mark.parametrize("call, message", [
    (lambda: step(gpus=0), "gpus=0 must be a whole number >= 1"),
    (lambda: step(gpus=2.5), "gpus=2.5 must be a whole number >= 1"),
    (lambda: step(model=-1), "model (parameter count)=-1 must be a number > 0"),
    (lambda: step(model="gpt5"), "model='gpt5' is not a known preset; allowed: gpt2"),
    (lambda: step(link="nvlink9"), "link='nvlink9' is not supported; allowed: 'nvlink3'"),
    (lambda: step(link=None), "give link= (a labkit.hardware.LINKS key) or bandwidth="),
    (lambda: step(bandwidth=0), "bandwidth=0 must be a number > 0"),
    (lambda: step(latency=-1), "latency=-1 must be a number >= 0"),
    (lambda: step(overlap=1.5), "overlap=1.5 must be a number >= 0 and <= 1"),
    (lambda: step(overlap=float("nan")), "overlap=nan must be a number >= 0"),
    (lambda: step(backward_fraction=0), "backward_fraction=0 must be a number > 0 and <= 1"),
    (lambda: step(bucket_size_mb=0), "bucket_size_mb=0 must be a number >= 9.53674e-07"),
    (lambda: step(grad_bytes="fp64"), "grad_bytes='fp64' is not supported; allowed: 'fp32'"),
    (lambda: step(grad_bytes=0), "grad_bytes=0 must be a number > 0 and <= 16"),
    (lambda: step(compute_seconds=None), "give compute_seconds="),
    (lambda: step(flops=1e15), "give compute_seconds="),
    (lambda: step(compute_seconds=None, flops=1e15), "flops= needs gpu="),
    (lambda: step(compute_seconds=None, flops=1e15, gpu="h100-sxm", mfu=2),
     "mfu=2 must be a number >= 0.001 and <= 1"),
    (lambda: step(compute_seconds=None, flops=1e15, gpu="t4", mfu=0.5),
     "dtype='bf16' is not supported; allowed: 'fp32', 'fp16'"),
    (lambda: step(compute_seconds=float("inf")), "compute_seconds=inf must be a number > 0"),
    (lambda: step(algorithm="star"), "algorithm='star' is not supported"),
    (lambda: sc.scaling_curve("gpt2", 8, scaling="medium", compute_seconds=1),
     "scaling='medium' is not supported; allowed: 'weak', 'strong'"),
    (lambda: sc.scaling_curve("gpt2", [], compute_seconds=1), "gpus has 0 distinct counts"),
    (lambda: sc.scaling_curve("gpt2", 8, threshold=0, compute_seconds=1), "threshold=0"),
    (lambda: sc.scaling_curve("gpt2", 8, at_gpus=0, compute_seconds=1), "at_gpus=0 must be"),
    (lambda: step(compute_seconds=None, flops=1e26, gpu="t4", mfu=0.001, dtype="fp16"),
     "flops=1e26 at mfu=0.001 of NVIDIA T4 16GB's 6.5e13 FLOP/s (fp16) take 1.53846e15 s; "
     "allowed: a step of at most 1e7 s"),
    (lambda: sc.throughput_loss(-0.1), "step_time_increase=-0.1 must be a number >= 0"),
    (lambda: sc.straggler([]), "rank_seconds has 0 values"),
    (lambda: sc.straggler(3.0), "rank_seconds=3.0 must be a list of seconds"),
    (lambda: sc.straggler([1.0, -1.0]), "rank_seconds[1]=-1.0 must be a number > 0"),
    (lambda: sc.distributed_sampler_indices(10, 4, 4), "rank=4 must be a whole number from 0 to 3"),
    (lambda: sc.distributed_sampler_indices(10, 4, -1), "rank=-1 must be a whole number from 0"),
    (lambda: sc.distributed_sampler_indices(0, 4, 0), "dataset_len=0 must be a whole number >= 1"),
    (lambda: sc.distributed_sampler_indices(10, 0, 0), "num_replicas=0 must be a whole number"),
    (lambda: sc.distributed_sampler_indices(10, 2, 0, drop_last="yes"), "drop_last='yes' is not"),
    (lambda: sc.accumulation_communication("gpt2", 4, 0), "microbatches=0 must be a whole number"),
    (lambda: sc.accumulation_communication("gpt2", 4, 2, no_sync=None), "no_sync=None is not"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value).startswith(message), str(exc.value)
