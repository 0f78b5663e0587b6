"""labkit.comm: nccl-tests' busbw, alpha-beta times, and each strategy's traffic per step."""
from __future__ import annotations

import pytest

from labkit.comm import (OPS, algbw, bus_bandwidth, bus_factor, bytes_sent_per_rank,
                         collective_time, step_communication)
from labkit.models import get_model


def test_nccl_tests_bus_factors():
    n = 8
    assert bus_factor("all_reduce", n) == 2 * 7 / 8
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, n) == 7 / 8
    for op in ("broadcast", "reduce", "send_recv"):
        assert bus_factor(op, n) == 1


def test_busbw_example():
    # 1 GB all-reduce in 10 ms on 8 ranks: algbw 100 GB/s, busbw 175 GB/s
    assert algbw(1e9, 0.01) == pytest.approx(100e9)
    assert bus_bandwidth("all_reduce", 1e9, 0.01, 8) == pytest.approx(175e9)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_ring_time_gives_busbw_equal_to_link_bandwidth(op, n):
    """The point of busbw: a ring at zero latency runs every collective at busbw = B."""
    B, S = 25e9, 3e9
    t = collective_time(op, S, n, B)
    assert bus_bandwidth(op, S, t, n) == pytest.approx(B)


def test_alpha_beta_ring_formulas():
    S, n, B, a = 14e9, 8, 25e9, 5e-6
    assert collective_time("all_reduce", S, n, B, a) == pytest.approx(
        2 * 7 * a + 2 * 7 / 8 * S / B)
    assert collective_time("all_gather", S, n, B, a) == pytest.approx(7 * a + 7 / 8 * S / B)
    assert collective_time("send_recv", S, n, B, a) == pytest.approx(a + S / B)
    assert collective_time("all_reduce", S, 1, B, a) == 0


def test_tree():
    S, B, a = 1e6, 25e9, 5e-6
    assert collective_time("all_reduce", S, 16, B, a, "tree") == pytest.approx(
        2 * 4 * a + 2 * S / B)
    assert collective_time("broadcast", S, 5, B, a, "tree") == pytest.approx(3 * a + S / B)
    # small messages: the tree's log-depth latency wins
    assert collective_time("all_reduce", 1e3, 64, B, a, "tree") < \
        collective_time("all_reduce", 1e3, 64, B, a)
    with pytest.raises(ValueError, match="algorithm='tree' is not defined for "
                                         "op='all_gather'"):
        collective_time("all_gather", S, 8, B, a, "tree")


def test_ddp_and_zero_volumes():
    """ZeRO paper §7: ZeRO-1/2 move 2 Psi like DDP; ZeRO-3 3 Psi, 1.5x."""
    psi, dp = 7e9, 8
    ddp = step_communication("ddp", num_params=psi, dp=dp)
    assert ddp.by_op == {"all_reduce": (1, 2 * 7 / 8 * psi * 4)}
    assert ddp.payload == {"all_reduce": (1, psi * 4)}
    for stage in ("zero1", "zero2"):
        c = step_communication(stage, num_params=psi, dp=dp)
        assert set(c.by_op) == {"reduce_scatter", "all_gather"}
        assert c.total_bytes == pytest.approx(ddp.total_bytes)
    z3 = step_communication("zero3", num_params=psi, dp=dp)
    assert z3.by_op["all_gather"][0] == 2 and z3.by_op["reduce_scatter"][0] == 1
    assert z3.total_bytes == pytest.approx(1.5 * ddp.total_bytes)
    # mixed precision: bf16 gradients halve DDP's traffic
    assert step_communication("ddp", num_params=psi, dp=dp, grad_bytes=2).total_bytes == \
        pytest.approx(ddp.total_bytes / 2)


def test_fsdp_per_unit():
    spec = get_model("llama2-7b")
    c = step_communication("fsdp", model=spec, dp=8)
    L = spec.num_layers
    assert c.by_op["all_gather"][0] == L + 1 + L      # root keeps its weights for backward
    assert c.by_op["reduce_scatter"][0] == L + 1
    assert c.payload["reduce_scatter"][1] == pytest.approx(spec.num_params() * 4)
    even = step_communication("fsdp", num_params=1e9, dp=4, units=10)
    assert even.by_op["all_gather"] == (20, pytest.approx(2 * 1e9 * 4 * 3 / 4))
    no_reshard = step_communication("fsdp", num_params=1e9, dp=4, units=10,
                                    reshard_after_forward=False)
    assert no_reshard.by_op["all_gather"][0] == 10


def test_tensor_parallel_megatron():
    spec = get_model("llama2-7b")
    b, s, h, t = 1, 4096, 4096, 4
    S = b * s * h * 2
    c = step_communication("tp", model=spec, tp=t, batch_size=b, seq_len=s)
    assert c.payload == {"all_reduce": (4 * 32, 4 * 32 * S)}        # 2 fwd + 2 bwd per layer
    assert c.by_op["all_reduce"][1] == pytest.approx(4 * 32 * S * 2 * 3 / 4)
    sp = step_communication("tp", model=spec, tp=t, batch_size=b, seq_len=s,
                            sequence_parallel=True)
    assert sp.payload == {"all_gather": (128, 128 * S), "reduce_scatter": (128, 128 * S)}
    assert sp.total_bytes == pytest.approx(c.total_bytes)            # same volume
    full = step_communication("tp", model=spec, tp=t, batch_size=b, seq_len=s, recompute="full")
    assert full.by_op["all_reduce"][0] == 6 * 32                     # forward's 2 again


def test_pipeline_and_context_parallel():
    spec = get_model("llama2-7b")
    S = 2 * 4096 * 4096 * 2
    c = step_communication("pp", model=spec, pp=4, microbatches=8, batch_size=2, seq_len=4096)
    assert c.by_op == {"send_recv": (16, 16 * S)}      # middle stage: fwd + bwd per micro-batch
    assert step_communication("pp", model=spec, pp=2, microbatches=8,
                              seq_len=4096).by_op["send_recv"][0] == 8
    assert step_communication("pp", model=spec, pp=1, seq_len=4096).by_op == {}
    inter = step_communication("pp", model=spec, pp=4, microbatches=8, chunks=2, seq_len=4096)
    assert inter.by_op["send_recv"][0] == 32
    cp = step_communication("cp", model="llama3-8b", cp=4, seq_len=8192)
    kv = 2 * 1 * 2048 * 8 * 128 * 2
    assert cp.by_op == {"send_recv": (3 * 3 * 32, 9 * 32 * kv)}


def test_bytes_sent_per_rank_matches_busbw_factor():
    assert bytes_sent_per_rank("all_reduce", 8e9, 8) == 14e9
    assert bytes_sent_per_rank("all_gather", 8e9, 1) == 0


@pytest.mark.parametrize("call, match", [
    (lambda: collective_time("allreduce", 1, 2, 1), "op='allreduce' is not supported; allowed"),
    (lambda: collective_time("all_reduce", 1, 0, 1), "world_size=0"),
    (lambda: collective_time("all_reduce", -1, 2, 1), "nbytes=-1"),
    (lambda: collective_time("all_reduce", 1, 2, 0), "bandwidth=0 must be a number > 0"),
    (lambda: bus_bandwidth("all_reduce", 1, 0, 2), "seconds=0"),
    (lambda: step_communication("dp", num_params=1), "strategy='dp' is not supported"),
    (lambda: step_communication("ddp"), "needs model= or num_params="),
    (lambda: step_communication("tp", num_params=1e9, tp=2), "needs model="),
    (lambda: step_communication("tp", model="llama2-70b", tp=16, seq_len=128),
     "tp=16 does not divide num_kv_heads=8"),
    (lambda: step_communication("cp", model="gpt2", cp=3, seq_len=1024), "cp=3 does not divide"),
    (lambda: step_communication("pp", model="debug", pp=5, seq_len=64), "pp=5 is larger"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_zero2_reduce_scatters_every_micro_batch():
    """ZeRO-2 keeps only its gradient shard, so each micro-batch's gradients are reduce-scattered
    (DeepSpeed: stage >= 2 communicates off the accumulation boundary); ZeRO-1 and DDP reduce
    once per step."""
    psi, dp, m = 1e9, 8, 4
    z1 = step_communication("zero1", num_params=psi, dp=dp, microbatches=m)
    z2 = step_communication("zero2", num_params=psi, dp=dp, microbatches=m)
    assert z1.by_op["reduce_scatter"][0] == 1 and z2.by_op["reduce_scatter"][0] == m
    assert z1.by_op["all_gather"] == z2.by_op["all_gather"] == (1, pytest.approx(psi * 4 * 7 / 8))
    assert z2.payload["reduce_scatter"] == (m, pytest.approx(m * psi * 4))
    assert step_communication("ddp", num_params=psi, dp=dp, microbatches=m).by_op[
        "all_reduce"][0] == 1


def test_sequence_parallel_paper_minimum_and_megatron_regather():
    # Korthikanti et al. 2022 §4.2.2: per layer 2 all-gathers + 2 reduce-scatters forward and
    # the same backward (4 + 4); Megatron-LM re-gathers each column-parallel linear's input in
    # the backward (attention QKV and MLP fc1: 2 more all-gathers), 6 + 4.
    spec = get_model("llama2-7b")
    kw = dict(model=spec, tp=4, batch_size=1, seq_len=4096, sequence_parallel=True)
    L, S = spec.num_layers, 1 * 4096 * spec.hidden_size * 2
    paper = step_communication("tp", **kw)
    megatron = step_communication("tp", **kw, sp_regather=True)
    assert paper.payload == {"all_gather": (4 * L, 4 * L * S), "reduce_scatter": (4 * L, 4 * L * S)}
    assert megatron.payload == {"all_gather": (6 * L, 6 * L * S),
                                "reduce_scatter": (4 * L, 4 * L * S)}
    assert megatron.total_bytes == pytest.approx(paper.total_bytes * 10 / 8)
    with pytest.raises(ValueError, match="sp_regather=True .* needs sequence_parallel=True"):
        step_communication("tp", model=spec, tp=4, sp_regather=True)
    with pytest.raises(ValueError, match="sp_regather='yes' is not supported"):
        step_communication("tp", **kw, sp_regather="yes")
