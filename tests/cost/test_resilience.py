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
