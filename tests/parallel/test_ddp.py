"""labkit.parallel.ddp: NaiveDDP, OverlappedDDP and BucketedDDP against one process, on 2 and 4
ranks (tests/fixtures/labs/ddp_parity.py, gloo), their collectives counted; assign_buckets by itself; the
bad arguments; what a one-rank process group shows (dtypes, order of calls, no_sync)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings, strategies as st
from torch import nn

from labkit.parallel.ddp import MB, BucketedDDP, NaiveDDP, OverlappedDDP, assign_buckets

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
_spec = importlib.util.spec_from_file_location("ddp_parity", LABS / "ddp_parity.py")
lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab)            # its model's sizes (V, D, H): the lab runs in ranks
V, D, H = lab.V, lab.D, lab.H

# The model's parameters to synchronise, in registration order: the tied head.weight is
# emb.weight, and frozen.* have requires_grad=False.
SYNCED = [("emb.weight", V * D), ("fc1.weight", H * D), ("fc1.bias", H),
          ("fc2.weight", D * H), ("fc2.bias", D)]
P = sum(n for _, n in SYNCED)
ALL_TENSORS = len(SYNCED) + 2 + 1                       # + frozen weight and bias, + the buffer
ALL_ELEMENTS = P + D * D + D + D
# Buckets fill in reverse order of registration. At 1700 bytes: fc2.bias (64) + fc2.weight
# (1536) + fc1.bias (96) = 1696 fit; fc1.weight (1536) would pass the cap and closes the bucket;
# emb.weight (2048) is larger than the cap: a bucket of its own.
BUCKETS = {"bucketed": [[n for n, _ in reversed(SYNCED)]],
           "bucketed_1700B": [["fc2.bias", "fc2.weight", "fc1.bias"], ["fc1.weight"],
                              ["emb.weight"]],
           "bucketed_1B": [[n] for n, _ in reversed(SYNCED)]}
ALL_REDUCES = {"naive": len(SYNCED), "overlapped": len(SYNCED),
               **{name: len(b) for name, b in BUCKETS.items()}}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "ddp_parity.py", nproc=request.param, timeout=180, quiet=True).results


@pytest.mark.multirank
@pytest.mark.parametrize("impl", lab.IMPLS)
def test_training_matches_one_process_on_the_whole_batch(ranks, impl):
    train = ranks[0][impl]["train"]
    assert train["param_diff"] < 1e-5, train              # fp32 rounding only (seen: 2.4e-7)
    for rank in ranks:                                    # replicas started apart (own seeds)
        assert rank[impl]["train"]["replica_diff"] == 0.0
        assert rank[impl]["train"]["frozen_diff"] == 0.0
        assert rank[impl]["train"]["frozen_grads"] == 0


@pytest.mark.multirank
@pytest.mark.parametrize("impl", lab.IMPLS)
def test_collectives_per_step(ranks, impl):
    expected = {"all_reduce": [ALL_REDUCES[impl], 4 * P]}  # every gradient once, fp32
    for rank in ranks:
        comm = rank[impl]["train"]["comm"]
        assert comm["construct"] == {"broadcast": [ALL_TENSORS, 4 * ALL_ELEMENTS]}
        if impl == "naive":                               # nothing until backward is over
            assert (comm["backward"], comm["finish"]) == ({}, expected)
        else:                                             # launched during backward
            assert (comm["backward"], comm["finish"]) == (expected, {})


@pytest.mark.multirank
@pytest.mark.parametrize("impl", BUCKETS)
def test_bucket_assignment_of_the_model(ranks, impl):
    # bucketed_1B lists what is synchronised: each trainable parameter once (not head.weight)
    assert 4 * (D + D * H + H) == 1696 < 1700 < 1696 + 4 * H * D   # the arithmetic above
    assert ranks[0][impl]["buckets"] == BUCKETS[impl]


@pytest.mark.multirank
@pytest.mark.parametrize("impl", lab.IMPLS)
def test_no_sync_accumulation_equals_the_big_batch(ranks, impl):
    acc = ranks[0][impl]["accumulation"]
    assert acc["grad_diff"] < 1e-6, acc
    for rank in ranks:
        acc = rank[impl]["accumulation"]
        assert acc["no_sync_comm"] == [{}] * (lab.K - 1)  # nothing inside no_sync()
        assert acc["step_comm"] == {"all_reduce": [ALL_REDUCES[impl], 4 * P]}   # one sync


@pytest.mark.multirank
@pytest.mark.parametrize("impl", lab.IMPLS)
def test_an_unused_parameter_gets_the_average_without_hanging(ranks, impl):
    for rank in ranks:   # gloo may sum a flat bucket in another order than one tensor: 1 ulp
        assert rank[impl]["unused"].keys() == {"some", "none"}
        assert max(rank[impl]["unused"].values()) < 1e-6, rank[impl]["unused"]


# ---------------------------------------------------------------------------------------------
# assign_buckets alone

def test_assign_buckets_reverses_and_caps():
    assert assign_buckets([300, 500, 400, 100], 800 / MB) == [[3, 2], [1, 0]]
    assert assign_buckets([100, 2000, 100], 1000 / MB) == [[2], [1], [0]]  # too big: alone
    assert assign_buckets([100] * 4, 25.0) == [[3, 2, 1, 0]]
    assert assign_buckets([], 25.0) == []


def test_assign_buckets_counts_tensor_bytes_and_splits_dtypes():
    f32, f64 = torch.zeros(100), torch.zeros(50, dtype=torch.float64)   # 400 bytes each
    assert assign_buckets([f32, f32.clone()], 800 / MB) == [[1, 0]]
    assert assign_buckets([f32, f32.clone()], 799 / MB) == [[1], [0]]
    assert assign_buckets([f32, f64, f32.clone()], 25.0) == [[2], [1], [0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=30), st.integers(1, 6000))
def test_assign_buckets_properties(sizes, cap):
    buckets = assign_buckets(sizes, cap / MB)
    assert [i for b in buckets for i in b] == list(reversed(range(len(sizes))))
    for b, after in zip(buckets, buckets[1:] + [None]):
        total = sum(sizes[i] for i in b)
        assert total <= cap or len(b) == 1                # over the cap only alone
        if after is not None:                             # closed only when the next would pass
            assert total + sizes[after[0]] > cap


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "25"])
def test_bad_bucket_sizes_are_refused(bad):
    with pytest.raises(ValueError, match=r"bucket_size_mb=.* must be a number > 0"):
        assign_buckets([100], bad)
    with pytest.raises(ValueError, match=r"bucket_size_mb=.* must be a number > 0"):
        BucketedDDP(nn.Linear(2, 2), bucket_size_mb=bad)   # before the process group check


@pytest.mark.parametrize("bad", [-1, 2.5, None, "x"])
def test_assign_buckets_refuses_what_is_not_a_size(bad):
    with pytest.raises(ValueError, match=r"params_or_sizes\[1\]=.* allowed: parameters"):
        assign_buckets([10, bad], 25.0)


@pytest.mark.parametrize("cls", [NaiveDDP, OverlappedDDP, BucketedDDP])
def test_what_is_not_a_module_is_refused(cls):
    with pytest.raises(ValueError, match=r"module=\[.* is a list; allowed: a torch.nn.Module"):
        cls([nn.Linear(2, 2)])


@pytest.mark.parametrize("cls", [NaiveDDP, OverlappedDDP, BucketedDDP])
def test_without_a_process_group_it_says_to_call_setup(cls):
    assert not tdist.is_initialized()
    with pytest.raises(RuntimeError, match=rf"{cls.__name__} needs the process group.*"
                                           r"labkit\.runtime\.dist\.setup\(\)"):
        cls(nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# on a one-rank process group, in this process

@pytest.fixture
def one_rank():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


class Mixed(nn.Module):
    """An fp32 and an fp64 parameter: two buckets, whatever the cap."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 4))
        self.b = nn.Parameter(torch.randn(4, 2, dtype=torch.float64))

    def forward(self, x):
        return (x @ self.a).double() @ self.b


@pytest.mark.parametrize("cls", [NaiveDDP, OverlappedDDP, BucketedDDP])
def test_gradients_keep_their_dtype_and_tensor(one_rank, cls):
    plain, model = Mixed(), Mixed()
    model.load_state_dict(plain.state_dict())
    ddp = cls(model)
    x = torch.randn(5, 3)
    plain(x).square().sum().backward()
    ddp(x).square().sum().backward()
    before = [p.grad for p in model.parameters()]
    ddp.finish_gradient_synchronization()
    for p, q, g in zip(model.parameters(), plain.parameters(), before):
        assert p.grad is g and p.grad.dtype == p.dtype   # averaged in place, dtype kept
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    if cls is BucketedDDP:
        assert ddp.buckets == [["b"], ["a"]]              # one flat buffer per dtype


@pytest.mark.parametrize("cls", [OverlappedDDP, BucketedDDP])
def test_a_second_backward_before_finish_is_refused(one_rank, cls):
    ddp = cls(nn.Linear(3, 2))
    ddp(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"second backward.*before "
                                           r"finish_gradient_synchronization\(\).*no_sync"):
        ddp(torch.randn(4, 3)).sum().backward()


@pytest.mark.parametrize("cls", [NaiveDDP, OverlappedDDP, BucketedDDP])
def test_finish_inside_no_sync_does_nothing_and_after_it_syncs(one_rank, cls):
    from labkit.runtime.measure import CollectiveCounter

    ddp = cls(nn.Linear(3, 2))
    with ddp.no_sync(), CollectiveCounter() as inside:
        ddp(torch.randn(4, 3)).sum().backward()
        ddp.finish_gradient_synchronization()
    with CollectiveCounter() as after:                    # no backward outside: finish sends
        ddp.finish_gradient_synchronization()
    assert inside.events == []
    assert after.by_kind["all_reduce"][1] == 4 * (3 * 2 + 2)
    ddp.module.bias.grad = None                           # unused: zeros are sent, then kept
    ddp.finish_gradient_synchronization()
    assert torch.equal(ddp.module.bias.grad, torch.zeros(2))


# (wrapper, all-reduces per step, of them launched before backward reaches layer 0): layers 2
# and 1 have a weight and a bias each
@pytest.mark.parametrize("cls, total, early", [(NaiveDDP, 6, 0), (OverlappedDDP, 6, 4),
                                               (BucketedDDP, 1, 0),     # 25 MiB: one bucket
                                               (lambda m: BucketedDDP(m, 1 / MB), 6, 4)])
def test_the_last_layers_are_sent_before_backward_reaches_the_first(one_rank, cls, total, early):
    from labkit.runtime.measure import CollectiveCounter

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    ddp = cls(model)
    seen = []
    model[0].register_full_backward_pre_hook(lambda *_: seen.append(len(comm.events)))
    x = torch.randn(4, 3, requires_grad=True)            # so that layer 0 runs a backward
    with CollectiveCounter() as comm:
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
    assert (len(comm.events), seen) == (total, [early])


def test_a_dropped_wrapper_stops_sending(one_rank):
    import gc

    from labkit.runtime.measure import CollectiveCounter

    model = nn.Linear(3, 2)
    OverlappedDDP(model)                                  # dropped at once (a cell run again)
    gc.collect()
    ddp = BucketedDDP(model)
    for _ in range(2):                                    # a stale hook would also refuse this
        with CollectiveCounter() as comm:
            ddp(torch.randn(4, 3)).sum().backward()
            ddp.finish_gradient_synchronization()
        assert comm.by_kind == {"all_reduce": (1, 4 * 8)}
    # the dropped wrapper's hooks are gone: one per parameter is left, BucketedDDP's
    assert [len(p._post_accumulate_grad_hooks) for p in model.parameters()] == [1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [NaiveDDP, OverlappedDDP, lambda m: BucketedDDP(m, 1 / MB)])
def test_on_cuda_over_nccl_in_bf16(cls):
    """Hooks run in autograd's CUDA thread, all-reduces on NCCL's stream: the averages (one
    rank: the gradients themselves) come back exact, in bf16, after three steps."""
    import copy

    from labkit.runtime.measure import CollectiveCounter

    tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1,
                             device_id=torch.device("cuda:0"))
    try:
        plain = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        plain = plain.to("cuda", torch.bfloat16)
        ddp = cls(copy.deepcopy(plain))
        for step in range(3):
            x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
            plain(x).float().square().mean().backward()
            with CollectiveCounter() as comm:
                ddp(x).float().square().mean().backward()
                ddp.finish_gradient_synchronization()
            assert comm.by_kind["all_reduce"] == (4, 2 * (64 * 256 * 2 + 256 + 64))
            for p, q in zip(ddp.module.parameters(), plain.parameters()):
                assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, q.grad)
                p.grad, q.grad = None, None
    finally:
        tdist.destroy_process_group()
