"""labkit.tp: one layer's TP communication vs compute, checked by hand on Llama-2-7B, by its
properties ((t-1)/t, bandwidth, NVLink vs InfiniBand, the crossing), against labkit.comm /
labkit.flops / labkit.memory, and on bad input."""
from __future__ import annotations

import math

import pytest

from labkit.comm import step_communication
from labkit.flops import flops_per_step
from labkit.hardware import LINKS, Link
from labkit.memory import estimate_memory
from labkit.models import get_model
from labkit.tp import (crossing_tp, first_crossing, layer_communication, layer_flops,
                       sweep_degrees, tp_cost, tp_sweep)

H100_BF16 = 989e12                 # dense BF16 FLOP/s, NVIDIA H100 SXM datasheet (1,979 / 2)
NVLINK4, ALPHA = 450e9, 2e-6       # bytes/s per direction (900 GB/s both ways), latency


def _link(bandwidth, latency=0.0):
    return Link("test link", bandwidth, 2 * bandwidth, "", latency, "intra-node")


def test_llama2_7b_on_eight_h100s_by_hand():
    """Llama-2-7B: h = 4096, 32 heads, ffn 11008; micro-batch 1 x 4096 tokens, bf16, tp = 8."""
    h, f, s, t = 4096, 11008, 4096, 8
    S = 1 * s * h * 2                                   # bytes of one b s h activation
    ring = 2 * (t - 1) * ALPHA + 2 * (t - 1) / t * S / NVLINK4
    params = 4 * h * h + 3 * h * f + 2 * h              # q k v o, gate up down, two RMSNorms
    flops = (6 * params + 3 * 4 * h * s) * s / t        # + 3 x forward attention (4 a d s)
    c = tp_cost("llama2-7b", tp=t, link="nvlink4", gpu="h100-sxm", mfu=0.5, seq_len=s)
    assert c.comm.by_op == {"all_reduce": (4, pytest.approx(4 * 2 * (t - 1) / t * S))}
    assert c.comm_time == pytest.approx(4 * ring, rel=1e-12)
    assert c.flops == pytest.approx(flops, rel=1e-12)
    assert c.compute_time == pytest.approx(flops / (0.5 * H100_BF16), rel=1e-12)
    comm, compute = 4 * ring, flops / (0.5 * H100_BF16)
    assert c.ratio == pytest.approx(comm / compute)
    assert c.efficiency_no_overlap == pytest.approx(compute / (compute + comm))
    assert c.efficiency_full_overlap == 1.0 and c.exposed_full_overlap == 0.0   # comm < compute
    assert 0.3 < c.ratio < 0.6 and not c.leaves_node


def test_sequence_parallelism_trades_each_all_reduce_for_an_all_gather_and_a_reduce_scatter():
    plain = tp_cost("llama2-7b", 4, seq_len=2048)
    sp = tp_cost("llama2-7b", 4, seq_len=2048, sequence_parallel=True)
    S = 2048 * 4096 * 2
    assert {op: n for op, (n, _) in sp.comm.payload.items()} == {"all_gather": 4,
                                                                 "reduce_scatter": 4}
    assert sp.comm.total_payload == 8 * S and plain.comm.total_payload == 4 * S
    assert sp.comm.total_bytes == pytest.approx(plain.comm.total_bytes)      # same ring bytes
    assert sp.comm_time == pytest.approx(plain.comm_time)                   # same alpha steps
    assert sp.compute_time == plain.compute_time
    assert sp.memory.activations < plain.memory.activations                 # what SP buys


def test_per_layer_counts_times_the_layers_are_the_steps():
    spec = get_model("debug-llama")
    for sp in (False, True):
        layer = layer_communication(spec, 4, batch_size=2, seq_len=64, sequence_parallel=sp)
        step = step_communication("tp", model=spec, tp=4, batch_size=2, seq_len=64,
                                  sequence_parallel=sp)
        assert {op: (n * spec.num_layers, b * spec.num_layers)
                for op, (n, b) in layer.by_op.items()} == step.by_op


def test_layer_flops_are_the_step_flops_less_the_head():
    """flops_per_step counts every layer plus the final norm and the LM head's matmul."""
    for name, s in (("llama2-7b", 4096), ("gpt2", 1024), ("llama3-70b", 8192)):
        spec = get_model(name)
        head = spec.vocab_size * spec.hidden_size + spec.final_norm_params()
        want = flops_per_step(spec, 2, s) - 6 * head * 2 * s
        assert spec.num_layers * layer_flops(spec, 2, s) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("t", [2, 4, 8, 16, 32])
def test_comm_grows_as_t_minus_one_over_t_and_compute_falls_as_one_over_t(t):
    link = _link(100e9)
    one, two, this = (tp_cost("llama2-7b", k, link=link, seq_len=1024) for k in (1, 2, t))
    assert one.comm_time == 0.0 and one.efficiency_no_overlap == 1.0
    assert this.comm_time / two.comm_time == pytest.approx(((t - 1) / t) / (1 / 2))
    assert this.compute_time * t == pytest.approx(one.compute_time)
    assert this.ratio / two.ratio == pytest.approx(t - 1)      # the ratio grows as t - 1


def test_comm_shrinks_with_bandwidth_and_nvlink_beats_infiniband():
    slow, fast = (tp_cost("llama2-13b", 8, link=_link(b), seq_len=2048) for b in (25e9, 100e9))
    assert fast.comm_time == pytest.approx(slow.comm_time / 4)
    for t in sweep_degrees("llama2-13b")[1:]:
        nv, ib = (tp_cost("llama2-13b", t, link=k) for k in ("nvlink4", "ib-ndr"))
        assert nv.comm_time < ib.comm_time and nv.compute_time == ib.compute_time
        assert nv.efficiency_no_overlap > ib.efficiency_no_overlap
        assert c_bounds(nv) and c_bounds(ib)


def c_bounds(c) -> bool:
    return 0 < c.efficiency_no_overlap <= c.efficiency_full_overlap <= 1


def test_tp_stays_inside_the_node():
    """Narayanan et al. 2021, §3.2: on NVLink every tp of one 8-GPU node computes more than it
    communicates; over one InfiniBand NDR port per GPU the communication wins within it."""
    for name in ("llama2-7b", "llama2-70b", "llama3-70b"):
        nv, ib = (crossing_tp(name, link=k, seq_len=4096) for k in ("nvlink4", "ib-ndr"))
        assert nv is None or nv > 8, (name, nv)
        assert ib is not None and ib <= 8, (name, ib)
        costs = tp_sweep(name, link="ib-ndr", seq_len=4096)
        before = [t for t in costs if t < ib]
        assert costs[ib].comm_time >= costs[ib].compute_time
        assert all(costs[t].comm_time < costs[t].compute_time for t in before)
        over = costs[ib]                      # comm >= compute: overlap hides only compute
        assert over.exposed_full_overlap == pytest.approx(over.comm_time - over.compute_time)
        assert over.efficiency_full_overlap == pytest.approx(over.compute_time / over.comm_time)
        assert over.efficiency_full_overlap < 1


def test_first_crossing_of_no_crossing_is_none():
    assert first_crossing(tp_sweep("debug-llama", link=_link(1e15), seq_len=64)) is None


def test_memory_per_rank_is_estimate_memorys():
    c = tp_cost("llama2-70b", 8, seq_len=4096, batch_size=2, sequence_parallel=True)
    want = estimate_memory("llama2-70b", batch_size=2, seq_len=4096, tp=8,
                           sequence_parallel=True)
    assert (c.memory.params, c.memory.activations) == (want.params, want.activations)
    one = tp_cost("llama2-70b", 1, seq_len=4096, batch_size=2)
    assert c.memory.params < one.memory.params / 7            # weights split, norms replicated


def test_tp_over_a_node_on_nvlink_is_flagged():
    assert tp_cost("llama2-7b", 16, link="nvlink4").leaves_node
    assert not tp_cost("llama2-7b", 16, link="ib-ndr").leaves_node
    assert LINKS["nvlink4"].scope == "intra-node"


def test_sweep_degrees_divide_the_sequence_with_sequence_parallelism():
    assert sweep_degrees("llama2-7b") == [1, 2, 4, 8, 16, 32]
    assert sweep_degrees("llama2-7b", seq_len=12, sequence_parallel=True) == [1, 2, 4]


@pytest.mark.parametrize("kwargs, start", [
    ({"tp": 3}, "tp=3 does not split llama2-7b: it must divide num_heads=32, num_kv_heads=32, "
                "ffn_size=11,008; allowed: 1, 2, 4, 8, 16, 32"),
    ({"tp": 0}, "tp=0 must be a whole number >= 1"),
    ({"tp": 2.5}, "tp=2.5 must be a whole number"),
    ({"mfu": 0}, "mfu=0 must be a number > 0 and <= 1"),
    ({"mfu": 1.5}, "mfu=1.5 must be a number > 0 and <= 1"),
    ({"mfu": math.nan}, "mfu=nan must be a number > 0"),
    ({"link": "nvlink9"}, "link='nvlink9' is not supported; allowed: 'nvlink3'"),
    ({"gpu": "h900"}, "gpu='h900' is not supported; allowed:"),
    ({"gpu": "t4"}, "precision='bf16-mixed' runs its matmuls in bf16, for which gpu='NVIDIA T4 "
                    "16GB' has no peak figure; allowed on it: 'fp32', 'fp16-mixed'"),
    ({"precision": "int4"}, "precision='int4' is not supported; allowed:"),
    ({"sequence_parallel": "yes"}, "sequence_parallel='yes' is not supported"),
    ({"seq_len": 100, "sequence_parallel": True},
     "tp=8 does not divide seq_len=100, which sequence parallelism splits over the tp ranks; "
     "allowed tp: 1, 2, 4"),
    ({"seq_len": 0}, "seq_len=0 must be a whole number >= 1"),
    ({"batch_size": 10**8, "seq_len": 10**8}, "batch_size=100,000,000 x seq_len=100,000,000 "
                                              "makes each collective carry 8.192e19 bytes"),
    ({"model": "gpt-5"}, "model='gpt-5' is not a known preset"),
])
def test_bad_input_is_a_message_naming_the_argument(kwargs, start):
    args = {"model": "llama2-7b", "tp": 8, **kwargs}
    with pytest.raises(ValueError) as exc:
        tp_cost(**args)
    assert str(exc.value).startswith(start), str(exc.value)
