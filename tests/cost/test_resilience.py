"""labkit.resilience: checkpoint size, write time, job MTBF, Young/Daly interval, overhead."""
from __future__ import annotations

import math

import pytest

from labkit.models import get_model
from labkit.resilience import (DAY, LLAMA3_FAILURE_RATE, LLAMA3_INTERRUPTIONS, checkpoint_bytes,
                               failures_per_day, job_mtbf, measured_failure_rate, overhead,
                               write_seconds, young_daly_interval)


def test_the_seed_is_wrong_by_24x():
    """0.01 %/GPU/day on 1,000 GPUs: 0.1 failures a day, one every 10 days, not every 10 hours;
    on 16,000 GPUs one every 15 hours."""
    assert failures_per_day(1000, 0.0001) == pytest.approx(0.1)
    assert job_mtbf(1000, 0.0001) == pytest.approx(10 * 24 * 3600)
    assert job_mtbf(1000, 0.0001) != pytest.approx(10 * 3600)
    assert job_mtbf(16_000, 0.0001) == pytest.approx(24 * 3600 / 1.6)
    assert job_mtbf(16_000, 0.0001) / 3600 == pytest.approx(15.0)


def test_checkpoint_size_and_write_time():
    n = get_model("llama2-7b").num_params()
    assert checkpoint_bytes("llama2-7b") == 12 * n          # fp32 weights + two fp32 moments
    assert checkpoint_bytes("llama2-7b", kind="export") == 2 * n
    assert checkpoint_bytes(1e9) == 12e9
    # 84 GB at 10 GB/s aggregate: 8.4 s; per node at 1 GB/s on 10 nodes: the same
    assert write_seconds(84e9, 10e9) == pytest.approx(8.4)
    assert write_seconds(84e9, 1e9, nodes=10, per_node=True) == pytest.approx(8.4)
    assert write_seconds(84e9, 1e9, nodes=10) == pytest.approx(84.0)   # shared: no speed-up


def test_young_daly_minimises_the_overhead():
    mtbf, delta = job_mtbf(16_000, 1e-4), 60.0
    tau = young_daly_interval(mtbf, delta)
    assert tau == pytest.approx(math.sqrt(2 * 54_000 * 60))
    best = overhead(tau, delta, mtbf)
    # at Young's interval the two terms are equal and the overhead is sqrt(2 delta / M)
    assert delta / tau == pytest.approx(tau / (2 * mtbf))
    assert best == pytest.approx(math.sqrt(2 * delta / mtbf))
    for other in (tau / 2, tau * 0.9, tau * 1.1, tau * 2):
        assert overhead(other, delta, mtbf) > best
    x = delta / (2 * mtbf)
    assert young_daly_interval(mtbf, delta, order=2) == pytest.approx(
        tau * (1 + math.sqrt(x) / 3 + x / 9) - delta)
    assert overhead(tau, delta, mtbf, restart_seconds=600) == pytest.approx(best + 600 / mtbf)
    # more GPUs: failures more often, checkpoint more often
    assert young_daly_interval(job_mtbf(1000, 1e-4), delta) > tau
    assert DAY == 86_400


@pytest.mark.parametrize("mtbf_min, want, digits", [(24 * 60, 117, 0), (6 * 60, 57, 0),
                                                    (15, 9.1, 1)])
def test_daly_reproduces_his_own_figures(mtbf_min, want, digits):
    """Daly (FGCS 22, 2006), delta = 5 min: M = 24 h, 117 min; 6 h, 57 min; 15 min, 9.1 min.
    sqrt(2 delta M) - delta gave 115, 55 and 7.2."""
    got = young_daly_interval(mtbf_min * 60, 300, order=2) / 60
    assert round(got, digits) == want, got
    assert round(young_daly_interval(mtbf_min * 60, 300) / 60 - 5, digits) != want


def test_daly_beyond_two_mtbfs_is_the_mtbf():
    assert young_daly_interval(100, 200, order=2) == 100
    assert young_daly_interval(100, 1e4, order=2) == 100
    x = 199 / 200                                                   # just below delta = 2M
    assert young_daly_interval(100, 199, order=2) == pytest.approx(
        math.sqrt(2 * 199 * 100) * (1 + math.sqrt(x) / 3 + x / 9) - 199)


def test_llama3_measured_rate():
    """The Llama 3 Herd of Models, section 3.3.4: 419 interruptions, 54 days, 16,384 GPUs."""
    assert LLAMA3_INTERRUPTIONS == {"interruptions": 419, "days": 54, "gpus": 16_384}
    assert LLAMA3_FAILURE_RATE == pytest.approx(419 / (54 * 16_384))
    assert round(100 * LLAMA3_FAILURE_RATE, 3) == 0.047                  # %/GPU/day
    assert job_mtbf(16_384, LLAMA3_FAILURE_RATE) == pytest.approx(54 * DAY / 419)  # 3.1 h
    assert measured_failure_rate(10, 1, 1000) == pytest.approx(1e-2)


@pytest.mark.parametrize("call, start", [
    (lambda: job_mtbf(0, 1e-4), "gpus=0"),
    (lambda: job_mtbf(1000, 0), "daily_failure_rate=0"),
    (lambda: job_mtbf(1000, 1.5), "daily_failure_rate=1.5"),
    (lambda: job_mtbf(1000, float("nan")), "daily_failure_rate=nan"),
    (lambda: write_seconds(1e9, 0), "bandwidth=0"),
    (lambda: write_seconds(1e9, 1e9, nodes=0, per_node=True), "nodes=0"),
    (lambda: write_seconds(-1, 1e9), "nbytes=-1"),
    (lambda: young_daly_interval(0, 10), "mtbf=0"),
    (lambda: young_daly_interval(100, 0, order=2), "write_time=0"),
    (lambda: young_daly_interval(100, 10, order=3), "order=3"),
    (lambda: overhead(0, 10, 100), "interval=0"),
    (lambda: checkpoint_bytes("llama2-7b", kind="fp8"), "kind='fp8'"),
    (lambda: checkpoint_bytes(-5), "model (parameter count)=-5"),
])
def test_bad_input_is_named(call, start):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value).startswith(start), str(exc.value)


# --- torchft: the others carry on (ft_lost_seconds, ft_overhead) ----------------------------

def test_ft_worked_example_from_the_docstring():
    """8 groups, 2 s steps, 5 s detection, 10 s heal, 10 min restart: the broken step commits
    max(1.5 x 2, 5) = 5 s after the failure instead of 1 s (4 s late), then 10 s of heal; 587 s
    of steps on 7/8 of the batch cost 587/8 s of samples."""
    from labkit.resilience import ft_lost_seconds
    kw = dict(detect_seconds=5, heal_seconds=10)
    assert ft_lost_seconds(600, 8, 2, count="steps", **kw) == pytest.approx(14.0)
    assert ft_lost_seconds(600, 8, 2, **kw) == pytest.approx(14 + 587 / 8)
    # checkpoint/restart loses the 10 min and, on average, half an interval of work
    assert ft_lost_seconds(600, 8, 2, **kw) < 600


def test_ft_the_step_count_does_not_wait_for_the_restart():
    from labkit.resilience import ft_lost_seconds
    steps = [ft_lost_seconds(d, 2, 0.25, detect_seconds=1.0, count="steps") for d in (2, 60, 600)]
    assert steps == [pytest.approx(0.875)] * 3             # 1.0 - 0.25/2: detection, not restart
    samples = [ft_lost_seconds(d, 2, 0.25, detect_seconds=1.0) for d in (2, 60, 600)]
    assert samples[0] < samples[1] < samples[2]
    # each second of downtime costs 1/R of a second of samples
    assert samples[2] - samples[1] == pytest.approx(540 / 2)
    assert ft_lost_seconds(600, 4, 0.25, detect_seconds=1.0) - ft_lost_seconds(
        60, 4, 0.25, detect_seconds=1.0) == pytest.approx(540 / 4)


def test_ft_a_quick_detection_still_redoes_the_step():
    """Detected within half a step, the broken step is simply done again: one step late."""
    from labkit.resilience import ft_lost_seconds
    assert ft_lost_seconds(5, 2, 2.0, detect_seconds=0.5, count="steps") == pytest.approx(2.0)
    assert ft_lost_seconds(5, 2, 2.0, count="steps") == pytest.approx(2.0)
    # a group back before the survivors' redo: at least the redone step trains on (R-1)/R
    assert ft_lost_seconds(0.1, 2, 2.0) == pytest.approx(2.0 + 2.0 / 2)


def test_ft_samples_never_below_steps_and_more_groups_lose_fewer():
    from labkit.resilience import ft_lost_seconds
    for r in (2, 3, 8, 64):
        steps = ft_lost_seconds(120, r, 1.0, detect_seconds=5, heal_seconds=2, count="steps")
        samples = ft_lost_seconds(120, r, 1.0, detect_seconds=5, heal_seconds=2)
        assert samples > steps
    by_groups = [ft_lost_seconds(120, r, 1.0, detect_seconds=5) for r in (2, 4, 8, 16)]
    assert by_groups == sorted(by_groups, reverse=True)


def test_ft_overhead_against_checkpoint_restart():
    """Llama 3's failure rate on 16,384 GPUs (a failure every ~3.1 h), 2 s steps, 64 groups,
    a 10 min restart: torchft loses 23 s a failure, ~0.2 % of samples; checkpoint/restart at
    Young's interval with 1 min writes and the same restart loses ~16 % (10 of it writing and
    redoing work, 5 restarting)."""
    from labkit.resilience import ft_lost_seconds, ft_overhead
    mtbf = job_mtbf(16_384, LLAMA3_FAILURE_RATE)
    ft = ft_overhead(mtbf, 600, 64, 2.0, detect_seconds=5, heal_seconds=10)
    assert ft == pytest.approx(ft_lost_seconds(600, 64, 2.0, detect_seconds=5,
                                               heal_seconds=10) / mtbf)
    ckpt = overhead(young_daly_interval(mtbf, 60), 60, mtbf, restart_seconds=600)
    assert 0.002 < ft < 0.0022 and 0.15 < ckpt < 0.16 and ft < ckpt / 50


@pytest.mark.parametrize("call, start", [
    (lambda f, o: f(600, 1, 2.0), "groups=1"),
    (lambda f, o: f(600, 0, 2.0), "groups=0"),
    (lambda f, o: f(0, 2, 2.0), "downtime=0"),
    (lambda f, o: f(600, 2, 0), "step_seconds=0"),
    (lambda f, o: f(600, 2, 2.0, detect_seconds=-1), "detect_seconds=-1"),
    (lambda f, o: f(600, 2, 2.0, heal_seconds=float("nan")), "heal_seconds=nan"),
    (lambda f, o: f(600, 2, 2.0, count="tokens"), "count='tokens'"),
    (lambda f, o: o(60, 600, 2, 2.0), "mtbf=60"),
    (lambda f, o: o(0, 600, 2, 2.0), "mtbf=0"),
])
def test_ft_bad_input_is_named(call, start):
    from labkit.resilience import ft_lost_seconds, ft_overhead
    with pytest.raises(ValueError) as exc:
        call(ft_lost_seconds, ft_overhead)
    assert str(exc.value).startswith(start), str(exc.value)


# --- one failure of a job that restarts from its checkpoint (labkit.labs.elastic measures it) ---

def test_a_failure_costs_the_work_since_the_checkpoint_and_the_restart():
    from labkit.resilience import expected_lost_seconds, goodput, restart_lost_seconds
    # killed 1 step of 0.3 s after the checkpoint, 4.2 s to start again: 4.5 s lost
    assert restart_lost_seconds(0.3, 4.2) == pytest.approx(4.5)
    assert restart_lost_seconds(0, 0) == 0.0                     # killed at a checkpoint, free
    # on average a failure lands half an interval after the last checkpoint
    assert expected_lost_seconds(600, 120) == pytest.approx(420)
    # times the failures of a run, overhead's work-lost and restart terms
    interval, write, mtbf, restart = 1800.0, 60.0, 86_400.0, 300.0
    per_failure = expected_lost_seconds(interval, restart) / mtbf
    assert overhead(interval, write, mtbf, restart) == pytest.approx(write / interval + per_failure)
    # at Young's interval: sqrt(write mtbf / 2) + restart
    tau = young_daly_interval(mtbf, write)
    assert expected_lost_seconds(tau, restart) == pytest.approx(
        math.sqrt(write * mtbf / 2) + restart)
    # 8 steps of 0.3 s and 4.5 s lost: 2.4 / 6.9 of the wall time trained
    assert goodput(2.4, 4.5) == pytest.approx(2.4 / 6.9)
    assert goodput(100.0) == 1.0 and goodput(90.0, 0, 10.0) == pytest.approx(0.9)


@pytest.mark.parametrize("call, start", [
    (lambda f: f.restart_lost_seconds(-1, 2), "since_checkpoint=-1"),
    (lambda f: f.restart_lost_seconds(1, float("nan")), "restart_seconds=nan"),
    (lambda f: f.expected_lost_seconds(0, 2), "interval=0"),
    (lambda f: f.expected_lost_seconds(10, -2), "restart_seconds=-2"),
    (lambda f: f.goodput(0), "work_seconds=0"),
    (lambda f: f.goodput(10, lost_seconds=-1), "lost_seconds=-1"),
    (lambda f: f.goodput(10, write_seconds=float("inf")), "write_seconds=inf"),
])
def test_restart_bad_input_is_named(call, start):
    import labkit.resilience as f
    with pytest.raises(ValueError) as exc:
        call(f)
    assert str(exc.value).startswith(start), str(exc.value)
