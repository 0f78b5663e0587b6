"""labkit.parallel.zero: ZeRO-1, ZeRO-2 and ZeRO-3 against one process on 2 and 4 ranks
(tests/fixtures/labs/zero_parity.py, gloo); per-rank state bytes (measure.state_bytes, which sees what a
sharded optimizer holds) against estimate_memory, padding included; collectives per step against
step_communication; torch's ZeroRedundancyOptimizer in the same run; the partition functions;
bad arguments; what a one-rank process group shows (ZeRO-2 accumulation, ZeRO-3 freeing)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings, strategies as st
from torch import nn

from labkit.comm import step_communication
from labkit.memory import estimate_memory
from labkit.parallel.zero import (FullyShardedModel, ShardedGradientOptimizer, ShardedOptimizer,
                                  padded_size, partition_parameters)
from labkit.runtime import measure

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
_spec = importlib.util.spec_from_file_location("zero_parity", LABS / "zero_parity.py")
lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab)            # its model's sizes: the lab runs in ranks
V, D, H = lab.V, lab.D, lab.H

# Trainable tensors in registration order (head.weight is emb.weight); the LayerNorm's two are
# not in a sharded module type: replicated under ZeRO-3.
SHARDED = [V * D, H * D, H, D * H, D]            # emb.weight, fc1.*, fc2.*
REPLICATED = [D, D]                              # norm.weight, norm.bias
P = sum(SHARDED) + sum(REPLICATED)
R = sum(REPLICATED)
TIED = V * D                                     # gathered again for the head


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "zero_parity.py", nproc=request.param, timeout=180, quiet=True).results


def fp32(n, stage, dp):
    return estimate_memory(n, precision="fp32", optimizer="adamw", zero_stage=stage, dp=dp)


def sharded_padded(n: int) -> int:
    """ZeRO-3 pads each sharded tensor on its own."""
    return sum(padded_size(s, n) for s in SHARDED)


def expected_state(variant: str, n: int) -> dict:
    """Per-rank bytes: estimate_memory's terms for the padded element counts (module docstring of
    labkit.parallel.zero: the flat buffer holds padded_size(P, n) elements)."""
    flat = padded_size(P, n)
    if variant.startswith("zero3"):
        sh, rep = fp32(sharded_padded(n), 3, n), fp32(R, 0, 1)
        return {"params": sh.params + rep.params, "grads": sh.grads + rep.grads,
                "optimizer_states": sh.optimizer_states + rep.optimizer_states,
                "optimizer_steps": 4 * (len(SHARDED) + len(REPLICATED))}
    stage = 2 if variant == "zero2" else 1
    m = fp32(flat, stage, n)
    # ZeRO-1 keeps the module's own gradients (P elements, no padding)
    grads = m.grads if stage == 2 else fp32(P, 1, n).grads
    return {"params": m.params, "grads": grads, "optimizer_states": m.optimizer_states,
            "optimizer_steps": 4}                 # one shard tensor: one AdamW step counter


# ---------------------------------------------------------------------------------------------
# on ranks


@pytest.mark.multirank
@pytest.mark.parametrize("variant", [v for v in lab.VARIANTS if v != "zero3_bf16"])
def test_each_stage_trains_like_one_process(ranks, variant):
    for rank in ranks:                                    # replicas started apart (own seeds)
        out = rank[variant]
        assert out["names"], out                          # tied head.weight included
        assert out["param_diff"] < 1e-5, out              # fp32 rounding only (seen: 6e-8)
        assert out["replica_diff"] == 0.0


@pytest.mark.multirank
def test_zero3_bf16_computes_in_bf16_with_fp32_masters(ranks):
    n = len(ranks)
    for rank in ranks:
        out = rank["zero3_bf16"]
        assert out["shard_dtypes"] == out["grad_dtypes"] == ["torch.float32"]
        assert out["replica_diff"] == 0.0
        # bf16 rounding flips some of AdamW's normalised updates (each at most ~lr): near, not equal
        assert out["param_diff"] < 8 * lab.LR, out
        gathered = 2 * (sharded_padded(n) + padded_size(TIED, n))   # 2 B per gathered element
        assert out["comm"]["forward"] == {"all_gather": [len(SHARDED) + 1, gathered]}
        assert out["comm"]["backward"]["all_gather"] == [len(SHARDED) + 1, gathered]
        assert out["comm"]["backward"]["reduce_scatter"][1] == 2 * gathered   # fp32 gradients


@pytest.mark.multirank
@pytest.mark.parametrize("variant", ["zero1", "zero1_reduce", "zero2", "zero3"])
def test_state_bytes_equal_estimate_memory(ranks, variant):
    n = len(ranks)
    expected = expected_state(variant, n)
    for rank in ranks:
        assert rank[variant]["state"] == expected
    # without padding the flat buffer would hold P: the difference is under n elements
    assert 0 <= padded_size(P, n) - P < n and padded_size(P, n) > P     # 1,385 does not divide


@pytest.mark.multirank
def test_collectives_per_step_match_step_communication(ranks):
    n = len(ranks)
    flat = padded_size(P, n)

    def payload(strategy, params):
        return {op: [c, b] for op, (c, b) in step_communication(strategy, num_params=params,
                                                                dp=n).payload.items()}
    for rank in ranks:
        z1, z1r, z2, z3 = (rank[v]["comm"] for v in ("zero1", "zero1_reduce", "zero2", "zero3"))
        # ZeRO-1 after DDP: DDP's all-reduce (one per tensor), then the all-gather
        assert z1["finish"] == {"all_reduce": [len(SHARDED) + len(REPLICATED), 4 * P]}
        assert z1["finish"]["all_reduce"][1] == payload("ddp", P)["all_reduce"][1]
        assert z1["step"] == {"all_gather": payload("zero1", flat)["all_gather"]}
        # ZeRO-1 reducing its own gradients, and ZeRO-2: reduce-scatter + all-gather
        assert {**z1r["backward"], **z1r["step"]} == payload("zero1", flat)
        assert z1r["backward"] == {}
        assert {**z2["backward"], **z2["step"]} == payload("zero2", flat)
        # ZeRO-3: the formula's 3 x 4P for the sharded tensors, plus the tied weight's second use
        # (gathered twice, reduce-scattered twice), plus the replicated LayerNorm's all-reduce
        z3_formula = payload("zero3", sharded_padded(n))
        extra = 4 * padded_size(TIED, n)
        count = len(SHARDED) + 1
        assert z3["forward"] == {"all_gather": [count, z3_formula["all_gather"][1] / 2 + extra]}
        assert z3["backward"] == {"all_gather": [count, z3_formula["all_gather"][1] / 2 + extra],
                                  "reduce_scatter": [count,
                                                     z3_formula["reduce_scatter"][1] + extra]}
        assert z3["finish"] == {"all_reduce": [len(REPLICATED), 4 * R]}
        assert z3["step"] == {}


@pytest.mark.multirank
def test_torch_zero_redundancy_optimizer_state_is_measured(ranks):
    # torch's optimizer gives whole tensors to ranks: partition_parameters' greedy split
    sizes = [4 * s for s in [V * D, H * D, H, D * H, D, D, D]]     # registration order
    owned = partition_parameters(sizes, len(ranks))
    for r, rank in enumerate(ranks):
        state = rank["torch_zero"]["state"]
        assert state["optimizer_states"] == 2 * sum(sizes[i] for i in owned[r])   # 2 moments
        assert state["optimizer_steps"] == 4 * len(owned[r])
        assert state["params"] == state["grads"] == 4 * P
    total = sum(rank["torch_zero"]["state"]["optimizer_states"] for rank in ranks)
    assert total == fp32(P, 1, len(ranks)).optimizer_states * len(ranks)


# ---------------------------------------------------------------------------------------------
# the pure functions


def test_partition_parameters_balances_bytes():
    assert partition_parameters([400, 100, 300, 200], 2) == [[0, 1], [2, 3]]
    assert partition_parameters([5, 5, 5], 2) == [[0, 2], [1]]       # ties: the lowest rank
    assert partition_parameters([], 3) == [[], [], []]
    assert padded_size(1385, 4) == 1388 and padded_size(1384, 4) == 1384


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=30), st.integers(1, 8))
def test_partition_parameters_properties(sizes, n):
    owned = partition_parameters(sizes, n)
    assert sorted(i for o in owned for i in o) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in o) for o in owned]
    assert max(loads) - min(loads) <= max(sizes, default=0)      # greedy's bound


@pytest.mark.parametrize("call, words", [
    (lambda: partition_parameters([1, -2], 2), ["sizes[1]=-2", "whole numbers of bytes"]),
    (lambda: partition_parameters([1, True], 2), ["sizes[1]=True"]),
    (lambda: partition_parameters([1], 0), ["world_size=0", ">= 1"]),
    (lambda: padded_size(0, 2), ["numel=0"]),
])
def test_bad_partition_arguments(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for w in words:
        assert w in str(err.value)


# ---------------------------------------------------------------------------------------------
# one rank: arguments, accumulation, freeing


@pytest.fixture
def one_rank():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def test_needs_a_process_group():
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="needs the process group"):
        ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="needs the process group"):
        FullyShardedModel(model)


@pytest.mark.parametrize("call, words", [
    (lambda m: ShardedOptimizer(m.parameters(), torch.optim.AdamW(m.parameters())),
     ["optimizer_class=", "subclass of torch.optim.Optimizer"]),
    (lambda m: ShardedOptimizer(m.weight, torch.optim.AdamW), ["params is one tensor"]),
    (lambda m: ShardedOptimizer([m.weight.requires_grad_(False)], torch.optim.AdamW),
     ["no trainable parameter"]),
    (lambda m: ShardedOptimizer([m.weight, nn.Parameter(torch.zeros(2, dtype=torch.float64))],
                                torch.optim.AdamW), ["mix dtypes", "one dtype"]),
    (lambda m: ShardedOptimizer([3], torch.optim.AdamW), ["params[0]=3", "parameters"]),
    (lambda m: ShardedOptimizer(m.parameters(), torch.optim.AdamW, reduce_gradients="yes"),
     ["reduce_gradients='yes'", "True"]),
    (lambda m: FullyShardedModel("model"), ["module='model'", "torch.nn.Module"]),
    (lambda m: FullyShardedModel(m, compute_dtype=torch.int32), ["compute_dtype=torch.int32",
                                                                  "floating"]),
    (lambda m: FullyShardedModel(m, shard=("Linear",)), ["shard=", "torch.nn.Module classes"]),
])
def test_bad_arguments(one_rank, call, words):
    with pytest.raises(ValueError) as err:
        call(nn.Linear(3, 2))
    for w in words:
        assert w in str(err.value)


def test_zero2_accumulates_shard_gradients_and_frees_the_full_ones(one_rank):
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 5), nn.Linear(3, 5)
    ref.load_state_dict(model.state_dict())
    opt = ShardedGradientOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 3)
    with measure.CollectiveCounter() as comm:
        for half in (x[:2], x[2:]):                     # two micro-batches, one step
            model(half).sum().backward()
    assert comm.by_kind == {"reduce_scatter": (2, 2 * 4 * 20)}          # one per backward
    assert all(p.grad is None for p in model.parameters())             # freed after reducing
    state = measure.state_bytes(model, opt)
    assert state.grads == 4 * 20                       # the shard's gradient, held by the optimizer
    ref(x).sum().backward()
    expected = torch.cat([ref.weight.grad.reshape(-1), ref.bias.grad])
    torch.testing.assert_close(opt.shard.grad, expected)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="no gradient"):
        opt.step()


def test_a_dropped_zero2_optimizer_stops_reducing(one_rank):
    import gc

    model = nn.Linear(3, 2)
    old = ShardedGradientOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    new = ShardedGradientOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)  # cell re-run
    del old
    gc.collect()
    with measure.CollectiveCounter() as comm:
        model(torch.ones(1, 3)).sum().backward()
    assert comm.by_kind == {"reduce_scatter": (1, 4 * 8)}
    assert new.shard.grad is not None


def test_a_sharded_module_cannot_be_wrapped_again(one_rank):
    module = nn.Sequential(nn.Linear(3, 4))
    FullyShardedModel(module)
    with pytest.raises(ValueError, match="already sharded"):
        FullyShardedModel(module)


def test_zero3_frees_gathered_weights_and_gives_every_parameter_a_gradient(one_rank):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    fsdp = FullyShardedModel(module)
    out = fsdp(torch.randn(5, 3))
    gathered = module[0]._labkit_zero3                 # this forward's gathered buffers
    assert gathered and all(t.untyped_storage().nbytes() == 0 for t in gathered)
    assert isinstance(module[0].weight, nn.Parameter) and module[0].weight.shape == (12,)
    out.sum().backward()
    assert all(t.untyped_storage().nbytes() == 0 for t in gathered)
    fsdp.finish_gradient_synchronization()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
    assert {k: v.shape for k, v in fsdp.gather_full_params().items()} == {
        "0.weight": (4, 3), "0.bias": (4,), "1.weight": (4,), "1.bias": (4,),
        "2.weight": (2, 4), "2.bias": (2,)}
