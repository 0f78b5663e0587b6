"""labkit.offload: the host-link (PCIe) time of CPU offload per training step, checked against
figures worked by hand from the link's lane rate, against labkit.placement / labkit.memory (the
same bytes the memory estimate puts on the host), and for its messages on bad input."""
from __future__ import annotations

import math

import pytest

from labkit.memory import estimate_memory
from labkit.offload import offload_cost
from labkit.placement import offload_traffic

P = 7e9
PCIE5 = 32e9 * 16 * (128 / 130) / 8          # bytes/s per direction: 32 GT/s x 16 lanes, 128b/130b
PCIE4 = PCIE5 / 2


def test_optimizer_offload_by_hand():
    # ZeRO-2, dp=8, bf16: each rank's shard is 875M parameters; 2 B gradients down, 2 B weights up
    c = offload_cost(P, "optimizer", zero_stage=2, dp=8, compute_seconds=1.0)
    shard_bytes = P / 8 * 2
    assert c.up == pytest.approx(shard_bytes / PCIE5)            # 27.8 ms
    assert c.down == pytest.approx(shard_bytes / PCIE5)
    assert c.up == pytest.approx(0.02778, rel=1e-3)
    # the weights come up after the CPU step: on the link one after the other, never hidden
    assert c.transfer == pytest.approx(c.up + c.down)
    assert c.hidden == pytest.approx(c.down)                     # backward 0.67 s hides the rest
    assert c.exposed == pytest.approx(c.up)
    assert c.step == pytest.approx(1.0 + c.up)


def test_optimizer_offload_not_overlapped_and_cpu_step():
    c = offload_cost(P, "optimizer", zero_stage=2, dp=8, compute_seconds=1.0, overlap=0.0,
                     cpu_step_seconds=0.25)
    assert c.hidden == 0.0
    assert c.exposed == pytest.approx(2 * P / 8 * 2 / PCIE5 + 0.25)
    # a backward shorter than the gradient copy hides only its own length
    short = offload_cost(P, "optimizer", zero_stage=2, dp=8, compute_seconds=0.015)
    assert short.hidden == pytest.approx(0.015 * 2 / 3)
    assert short.exposed == pytest.approx(short.transfer - 0.01)


def test_gradients_go_down_after_every_micro_batch_from_zero2():
    z2 = offload_cost(P, "optimizer", zero_stage=2, dp=8, microbatches=4, compute_seconds=1.0)
    z1 = offload_cost(P, "optimizer", zero_stage=1, dp=8, microbatches=4, compute_seconds=1.0)
    assert z2.down == pytest.approx(4 * z1.down) and z2.up == pytest.approx(z1.up)


def test_param_offload_streams_both_ways_at_once():
    # ZeRO-3, dp=8, 4 micro-batches, PCIe 4: weights up before 8 all-gathers, gradients down x 4
    c = offload_cost(P, "params", zero_stage=3, dp=8, microbatches=4, link="pcie4",
                     compute_seconds=0.3)
    shard = P / 8 * 2
    assert c.up == pytest.approx(8 * shard / PCIE4)              # 0.444 s
    assert c.down == pytest.approx(4 * shard / PCIE4)
    assert c.transfer == pytest.approx(c.up)                     # full duplex
    assert c.hidden == pytest.approx(0.3)
    assert c.exposed == pytest.approx(8 * shard / PCIE4 - 0.3)
    assert c.slowdown == pytest.approx(c.step / 0.3)
    hidden = offload_cost(P, "params", zero_stage=3, dp=8, microbatches=4, link="pcie4",
                          compute_seconds=2.0)
    assert hidden.exposed == 0.0 and hidden.slowdown == 1.0


@pytest.mark.parametrize("offload, stage", [("optimizer", 1), ("optimizer", 2),
                                            ("optimizer", 3), ("params", 3)])
def test_bytes_are_those_placement_and_memory_count(offload, stage):
    c = offload_cost("llama2-7b", offload, zero_stage=stage, dp=4, microbatches=2,
                     compute_seconds=1.0)
    assert c.traffic == offload_traffic("llama2-7b", offload=offload, zero_stage=stage, dp=4,
                                        microbatches=2)
    est = estimate_memory("llama2-7b", zero_stage=stage, dp=4, offload=offload)
    if offload == "params":      # the weight shard that lives on the host comes up 2m times
        assert c.traffic.host_to_device == pytest.approx(2 * 2 * est.host["params"])
    else:                        # the updated 16-bit weight shard: 1/dp of the weights (the
        shard = est.params / (1 if stage == 3 else 4)    # GPU's own shard under ZeRO-3)
        assert c.traffic.host_to_device == pytest.approx(shard)


def test_flops_give_the_compute():
    c = offload_cost(P, "optimizer", zero_stage=2, dp=8, flops=6 * P * 4096, gpu="h100-sxm",
                     mfu=0.5)
    assert c.compute == pytest.approx(6 * P * 4096 / (989e12 * 0.5))


def test_table_names_every_quantity():
    text = offload_cost(P, "optimizer", zero_stage=2, dp=8, compute_seconds=1.0).table()
    for shown in ("host -> GPU", "GPU -> host", "exposed", "PCIe 5.0 x16", "ZeRO-2"):
        assert shown in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload="none"), r"offload='none' is not supported; allowed: 'optimizer', 'params'"),
    (dict(offload="optimizer", zero_stage=0), "offload='optimizer' needs zero_stage >= 1"),
    (dict(offload="params", zero_stage=2), "offload='params' needs zero_stage=3"),
    (dict(overlap=1.5), r"overlap=1.5 must be a number >= 0 and <= 1"),
    (dict(overlap=math.nan), r"overlap=nan must be a number >= 0"),
    (dict(cpu_step_seconds=-1), r"cpu_step_seconds=-1 must be a number >= 0"),
    (dict(compute_seconds=None), "give compute_seconds="),
    (dict(compute_seconds=0), "compute_seconds=0 must be a number > 0"),
    (dict(link="nvme"), "link='nvme' is not supported"),
    (dict(dp=0), "dp=0 must be a whole number >= 1"),
])
def test_bad_input_is_a_message(kwargs, match):
    args = dict(offload="optimizer", zero_stage=2, dp=8, compute_seconds=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        offload_cost(P, **args)
