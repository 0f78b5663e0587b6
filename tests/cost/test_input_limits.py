"""The cost models refuse non-finite and absurd numbers (issue 10, point 12) with a ValueError
that names the argument, its value and the allowed range (`labkit.validate`), so that no
calculator, notebook or `labkit mem` prints inf, nan or a 300-digit number; anything inside the
limits gives finite results."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from labkit import validate
from labkit.cli import main
from labkit.comm import (algbw, bus_bandwidth, bytes_sent_per_rank, collective_time,
                         step_communication)
from labkit.flops import attention_flops_per_token, flops_per_step, flops_per_token, mfu
from labkit.memory import activation_bytes_per_layer, estimate_memory
from labkit.models import get_model
from labkit.pipeline import simulate

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("call, message", [
    # a plain parameter count
    (lambda: estimate_memory(INF), "model (parameter count)=inf must be a number > 0 and <= 1e15"),
    (lambda: estimate_memory(NAN), "model (parameter count)=nan must be a number > 0 and <= 1e15"),
    (lambda: estimate_memory(1e16), "model (parameter count)=1e+16 must be a number > 0 and "
                                    "<= 1e15"),
    (lambda: flops_per_token(INF), "model (parameter count)=inf must be a number > 0 and <= 1e15"),
    # batch, sequence, degrees
    (lambda: estimate_memory("llama2-7b", seq_len=10**9), "seq_len=1000000000 must be a whole "
                                                          "number >= 1 and <= 1e8"),
    (lambda: estimate_memory("llama2-7b", batch_size=10**300), "batch_size=1.00e300 must be a "
                                                               "whole number >= 1 and <= 1e8"),
    (lambda: estimate_memory("llama2-7b", dp=INF), "dp=inf must be a whole number >= 1 and <= 1e7"),
    (lambda: estimate_memory(7e9, pp=10**6), "pp=1000000 must be a whole number >= 1 and "
                                             "<= 100,000"),
    (lambda: activation_bytes_per_layer(4096, 1, 4096, NAN), "num_heads=nan must be a whole "
                                                             "number"),
    (lambda: flops_per_step("gpt2", 10**9, 1024), "batch_size=1000000000 must be a whole number "
                                                  ">= 1 and <= 1e8"),
    (lambda: attention_flops_per_token("gpt2", INF), "seq_len=inf must be a whole number"),
    (lambda: mfu("gpt2", INF, "h100-sxm"), "tokens_per_second=inf must be a number > 0 and "
                                           "<= 1e15"),
    (lambda: estimate_memory("debug", seq_len=128).fits(INF), "gpu=inf must be a number > 0 and "
                                                              "<= 1e18"),
    # sizes, bandwidths, latencies
    (lambda: collective_time("all_reduce", INF, 8, 1e9), "nbytes=inf must be a number >= 0 and "
                                                         "<= 1e18"),
    (lambda: collective_time("all_reduce", 2e18, 8, 1e9), "nbytes=2e+18 must be a number >= 0 "
                                                          "and <= 1e18"),
    (lambda: collective_time("all_reduce", 1e9, 8, INF), "bandwidth=inf must be a number > 0 and "
                                                         "finite"),
    (lambda: collective_time("all_reduce", 1e9, 8, 1e9, NAN), "latency=nan must be a number >= 0 "
                                                              "and <= 1,000"),
    (lambda: collective_time("all_reduce", 1e9, 8, 1e9, INF), "latency=inf"),
    # finite inputs whose results overflowed to inf (issue 11, point 11)
    (lambda: collective_time("all_reduce", 1e18, 8, 1e-300), "bandwidth=1e-300 must be a number "
                                                             ">= 1"),
    (lambda: collective_time("all_reduce", 1e18, 10**7, 1e9, 1e305), "latency=1e+305 must be a "
                                                                     "number >= 0 and <= 1,000"),
    (lambda: algbw(1e18, 1e-300), "seconds=1e-300 must be a number >= 1e-30"),
    (lambda: mfu("gpt2", 1e300, "h100-sxm"), "tokens_per_second=1e+300 must be a number > 0 and "
                                             "<= 1e15"),
    (lambda: step_communication("ddp", num_params=1e9, grad_bytes=1e300), "grad_bytes=1e+300 "
                                                                          "must be a number > 0 "
                                                                          "and <= 16"),
    (lambda: collective_time("all_reduce", 1e9, 10**8, 1e9), "world_size=100000000 must be a "
                                                             "whole number >= 1 and <= 1e7"),
    (lambda: bytes_sent_per_rank("all_gather", NAN, 4), "nbytes=nan"),
    (lambda: algbw(1e9, INF), "seconds=inf must be a number > 0 and finite"),
    (lambda: step_communication("ddp", num_params=INF), "num_params=inf must be a number > 0 and "
                                                        "<= 1e15"),
    (lambda: step_communication("ddp", num_params=1e9, grad_bytes=NAN), "grad_bytes=nan"),
    # a model's shape
    (lambda: get_model("debug").with_(num_layers=10**6), "num_layers=1000000 must be a whole "
                                                         "number >= 1 and <= 100,000"),
    (lambda: get_model("debug").with_(vocab_size=INF), "vocab_size=inf must be a whole number"),
    (lambda: get_model("debug").with_(hidden_size=10**7, ffn_size=10**8, num_heads=1,
                                      num_kv_heads=1),
     "ModelSpec 'debug' has 1.36e16 parameters (num_layers=4, hidden_size=10000000, "
     "ffn_size=100000000, vocab_size=1024); allowed: at most 1e15"),
    # the pipeline simulator's times
    (lambda: simulate("1f1b", 2, 4, fwd=INF), "fwd=inf must be a number > 0 and finite"),
    (lambda: simulate("1f1b", 2, 4, bwd=NAN), "bwd=nan must be a number > 0 and finite"),
])
def test_non_finite_and_absurd_values_are_refused(call, message):
    with pytest.raises(ValueError) as exc:
        call()
    assert message in str(exc.value)


def test_the_limits_themselves_are_accepted_and_give_finite_numbers():
    m = estimate_memory(validate.MAX_PARAMS, dp=validate.MAX_RANKS, zero_stage=3)
    assert math.isfinite(m.total) and m.total > 0
    assert math.isfinite(collective_time("all_reduce", validate.MAX_BYTES, validate.MAX_RANKS,
                                         1e9, 1e-3))
    assert math.isfinite(estimate_memory("llama2-7b", seq_len=2**20, batch_size=64).total)


ANY_NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                      st.integers(-10**30, 10**30), st.sampled_from([1e-300, 1e300, 5e-324]))
EXTREME = st.one_of(ANY_NUMBER, st.sampled_from([0.0, 5e-324, 1e-300, 1e-30, 1.0, 1e3, 1e18,
                                                 1e300, INF, NAN]))


@settings(max_examples=60, deadline=None)
@given(value=ANY_NUMBER, arg=st.sampled_from(["nbytes", "bandwidth", "latency"]))
def test_collective_time_is_finite_or_names_the_argument(value, arg):
    kw = {"nbytes": 1e9, "bandwidth": 1e10, "latency": 1e-5, arg: value}
    try:
        t = collective_time("all_reduce", world_size=8, **kw)
    except ValueError as exc:
        assert str(exc).startswith(f"{arg}=")
    else:
        assert math.isfinite(t) and t >= 0


@settings(max_examples=200, deadline=None)
@given(nbytes=EXTREME, bandwidth=EXTREME, latency=EXTREME,
       world_size=st.sampled_from([2, 8, 10**7]))
def test_collective_time_and_busbw_are_finite_for_every_accepted_input(nbytes, bandwidth,
                                                                      latency, world_size):
    """All arguments at their extremes at once (1e18 bytes over 1e-300 bytes/s was inf)."""
    try:
        t = collective_time("all_reduce", nbytes, world_size, bandwidth, latency)
    except ValueError as exc:
        assert str(exc).startswith(("nbytes=", "bandwidth=", "latency="))
        return
    assert math.isfinite(t) and t >= 0
    if t > 0:
        try:
            busbw = bus_bandwidth("all_reduce", nbytes, t, world_size)
        except ValueError as exc:
            assert str(exc).startswith("seconds=")
        else:
            assert math.isfinite(busbw)


def test_labkit_mem_inf_exits_2_with_a_message(capsys):
    assert main(["mem", "inf"]) == 2
    captured = capsys.readouterr()
    assert "model (parameter count)=inf must be a number > 0 and <= 1e15" in captured.err
    assert captured.out == ""
