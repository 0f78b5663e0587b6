"""labkit.resilience: checkpoint size, write time, job MTBF, Young/Daly interval, overhead."""
from __future__ import annotations

import math

import pytest

from labkit.models import get_model
from labkit.resilience import (DAY, checkpoint_bytes, failures_per_day, job_mtbf, overhead,
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
    assert young_daly_interval(mtbf, delta, order=2) == pytest.approx(tau - delta)
    assert overhead(tau, delta, mtbf, restart_seconds=600) == pytest.approx(best + 600 / mtbf)
    # more GPUs: failures more often, checkpoint more often
    assert young_daly_interval(job_mtbf(1000, 1e-4), delta) > tau
    assert DAY == 86_400


@pytest.mark.parametrize("call, start", [
    (lambda: job_mtbf(0, 1e-4), "gpus=0"),
    (lambda: job_mtbf(1000, 0), "daily_failure_rate=0"),
    (lambda: job_mtbf(1000, 1.5), "daily_failure_rate=1.5"),
    (lambda: job_mtbf(1000, float("nan")), "daily_failure_rate=nan"),
    (lambda: write_seconds(1e9, 0), "bandwidth=0"),
    (lambda: write_seconds(1e9, 1e9, nodes=0, per_node=True), "nodes=0"),
    (lambda: write_seconds(-1, 1e9), "nbytes=-1"),
    (lambda: young_daly_interval(0, 10), "mtbf=0"),
    (lambda: young_daly_interval(100, 60, order=2), "write_time=60"),
    (lambda: young_daly_interval(100, 10, order=3), "order=3"),
    (lambda: overhead(0, 10, 100), "interval=0"),
    (lambda: checkpoint_bytes("llama2-7b", kind="fp8"), "kind='fp8'"),
    (lambda: checkpoint_bytes(-5), "model (parameter count)=-5"),
])
def test_bad_input_is_named(call, start):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value).startswith(start), str(exc.value)
