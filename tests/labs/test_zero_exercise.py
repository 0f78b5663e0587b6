"""Module 04's exercises: the ZeRO-1 runner (labkit.labs.zero.exercise), where a learner's optimizer
reaches the ranks as source and runs beside one process with AdamW, every usual mistake coming
back as a sentence with its numbers; and the references the check cells compare with."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit.course import reference
from labkit.labs.ddp import exercise as dx
from labkit.labs.zero.exercise import run_user_zero1

TRAINABLE = [p for p in dx.TinyLM().parameters() if p.requires_grad]     # tied once
PSI = sum(4 * p.numel() for p in TRAINABLE)                               # fp32 bytes


# ----------------------------------------------------------------------- learners' answers

class GoodZeRO1:
    """Whole parameters, owners from the greedy partition, reduce + broadcast."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.n, rank = dist.get_world_size(), dist.get_rank()
        loads, self.owner = [0] * self.n, [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            self.owner[i] = loads.index(min(loads))
            loads[self.owner[i]] += self.params[i].numel()
        self.optimizer = optimizer_class(
            [p for p, o in zip(self.params, self.owner) if o == rank], **defaults)

    def reduce(self):
        for p, o in zip(self.params, self.owner):
            dist.reduce(p.grad, dst=o)
            p.grad /= self.n

    def send(self):
        with torch.no_grad():
            for p, o in zip(self.params, self.owner):
                dist.broadcast(p, src=o)

    def step(self):
        self.reduce()
        self.optimizer.step()
        self.send()


class FlatZeRO1:
    """DeepSpeed's way: one flat buffer padded to a multiple of N, reduce_scatter + all_gather."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.n, self.rank = dist.get_world_size(), dist.get_rank()
        self.total = sum(p.numel() for p in self.params)
        self.chunk = -(-self.total // self.n)
        flat = torch.zeros(self.chunk * self.n)
        flat[:self.total] = torch.cat([p.detach().flatten() for p in self.params])
        mine = flat[self.rank * self.chunk:(self.rank + 1) * self.chunk].clone()
        self.shard = torch.nn.Parameter(mine)
        self.optimizer = optimizer_class([self.shard], **defaults)

    def step(self):
        grads = torch.zeros(self.chunk * self.n)
        grads[:self.total] = torch.cat([p.grad.flatten() for p in self.params])
        out = torch.zeros(self.chunk)
        dist.reduce_scatter_tensor(out, grads)
        self.shard.grad = out / self.n
        self.optimizer.step()
        full = torch.zeros(self.chunk * self.n)
        dist.all_gather_into_tensor(full, self.shard.detach())
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


class SumsZeRO1(GoodZeRO1):
    def reduce(self):
        for p, o in zip(self.params, self.owner):
            dist.reduce(p.grad, dst=o)


class KeepsToItselfZeRO1(GoodZeRO1):
    def send(self):
        pass


class ReplicatedZeRO1(GoodZeRO1):
    """DDP's optimizer: every rank steps every parameter (all-reduced gradients)."""

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self.optimizer = optimizer_class(self.params, **defaults)

    def reduce(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.n


class SendsTwiceZeRO1(GoodZeRO1):
    def send(self):
        super().send()
        super().send()


class TorchsZeRO1:
    def __init__(self, params, optimizer_class, **defaults):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        self.inner = ZeroRedundancyOptimizer(list(params), optimizer_class, **defaults)

    def step(self):
        self.inner.step()


class HangingZeRO1(GoodZeRO1):
    """Only the owner calls broadcast: the others never join it."""

    def send(self):
        with torch.no_grad():
            for p, o in zip(self.params, self.owner):
                if o == dist.get_rank():
                    dist.broadcast(p, src=o)


class StubZeRO1:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        raise NotImplementedError("Exercise zero1: write ~7 lines")

    def step(self):
        raise NotImplementedError("Exercise zero1: write ~6 lines")


# ---------------------------------------------------------------- the references, without ranks

def test_the_zero_references_are_the_formulas_they_stand_for():
    """Stage k divides the optimizer states (k >= 1), gradients (k >= 2), weights (k = 3) of
    2 + 2 + 12 bytes per parameter; 7B on 4 GPUs is 112 / 49 / 38.5 / 28 GB (not the articles'
    84 / 42 / 31.5 / 21). DDP, ZeRO-1 and ZeRO-2 send 2 (N-1)/N S per rank, ZeRO-3 3 (N-1)/N S."""
    psi, n = 7e9, 4
    by_hand = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]
    assert [sum(reference.zero_bytes(psi, k, n)) for k in range(4)] == \
        pytest.approx(by_hand, rel=1e-12)
    assert [b / 1e9 for b in by_hand] == [112, 49, 38.5, 28]
    S, n = 2 * psi, 8
    assert [reference.zero_comm(psi, k, n) for k in range(4)] == \
        pytest.approx([2 * (n - 1) / n * S] * 3 + [3 * (n - 1) / n * S], rel=1e-12)
    assert reference.partition([300, 500, 400, 100], 2) == [[1, 3], [0, 2]]
    assert reference.partition([100] * 6, 4) == [[0, 4], [1, 5], [2], [3]]


@pytest.mark.parametrize("psi, stage, gpu", [(70e9, 3, 80e9), (7e9, 1, 40e9), (7e9, 2, 24e9),
                                             (7e9, 0, 112e9), (13e9, 2, 80e9), (1e9, 1, 5e9)])
def test_min_gpus_is_the_first_dp_that_fits(psi, stage, gpu):
    """The bisection finds what a linear search over estimate_memory finds."""
    from labkit.memory import estimate_memory

    dp = next(d for d in range(1, 10_000)
              if estimate_memory(psi, zero_stage=stage, dp=d).model_states <= gpu)
    assert reference.min_gpus(psi, stage, gpu) == dp


@pytest.mark.parametrize("psi, stage, gpu", [(70e9, 1, 80e9), (7e9, 0, 80e9), (40e9, 2, 80e9)])
def test_min_gpus_refuses_what_fits_on_no_number_of_gpus(psi, stage, gpu):
    with pytest.raises(ValueError, match=f"at ZeRO-{stage} fit on no number of GPUs"):
        reference.min_gpus(psi, stage, gpu)


def test_a_stub_fails_at_once_without_ranks():
    with pytest.raises(NotImplementedError, match="StubZeRO1 is not written yet"):
        run_user_zero1(StubZeRO1)


@pytest.mark.parametrize("kwargs, words", [
    ({"nproc": 1}, "nproc=1 must be >= 2"),
    ({"steps": 0}, "steps=0 must be a whole number >= 1"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        run_user_zero1(GoodZeRO1, **kwargs)


def test_a_function_is_refused_naming_what_it_takes():
    with pytest.raises(ValueError, match=r"run_user_zero1 takes a class \(your optimizer\); "
                                         r"received <function .* \(a function\)"):
        run_user_zero1(test_bad_arguments_are_named)


# ---------------------------------------------------------------------------- on real ranks

@pytest.mark.multirank
@pytest.mark.parametrize("cls", [GoodZeRO1, FlatZeRO1])
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_correct_zero1_equals_one_process_and_holds_one_replica_of_state(cls, nproc):
    r = run_user_zero1(cls, nproc=nproc)
    assert r.ok, r.summary()
    assert r.trainable_bytes == PSI and max(r.diff_single) < 1e-5
    # AdamW's two moments, 2 x PSI in all (plus the flat buffer's padding), none on two ranks
    assert 2 * PSI <= sum(r.state_bytes) <= 2 * PSI + 2 * 4 * nproc
    assert max(r.state_bytes) < 2 * PSI
    assert r.reduced_bytes == r.sent_bytes and PSI <= r.reduced_bytes[0] <= PSI + 4 * nproc
    if cls is GoodZeRO1:     # each parameter's state on its owner only
        assert sorted(i for held in r.held for i in held) == list(range(len(TRAINABLE)))


@pytest.mark.multirank
@pytest.mark.parametrize("cls, aspect, words", [
    (SumsZeRO1, "parameters", "average the gradients (the reduce sums: divide by the world size)"),
    (KeepsToItselfZeRO1, "parameters", "the updated parameters never left their owner"),
    (KeepsToItselfZeRO1, "bytes", "parameter bytes sent = 0 B"),
    (ReplicatedZeRO1, "sharded", "have optimizer state on several ranks; the ranks' optimizer "
                                 "states hold {two_replicas:,} B together"),
    (ReplicatedZeRO1, "sharded", "(ratio 2.000)"),
    (SendsTwiceZeRO1, "bytes", "parameter bytes sent = {two_psi:,} B; the trainable parameters "
                               "hold {psi:,} B (ratio 2.000)"),
    (TorchsZeRO1, "runs", "your TorchsZeRO1 uses torch's ZeroRedundancyOptimizer"),
])
def test_zero1_mistakes_are_named_with_their_numbers(cls, aspect, words):
    r = run_user_zero1(cls, nproc=2, steps=2)
    assert not r.ok
    want = words.format(psi=PSI, two_psi=2 * PSI, two_replicas=2 * 2 * PSI)
    assert want in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()


@pytest.mark.multirank
def test_a_hang_is_stopped_and_explained():
    from labkit import LabError

    with pytest.raises(LabError, match="HangingZeRO1 did not finish within 8 s on 2 ranks. A "
                                       "usual cause: the ranks did not issue the same "
                                       "collectives in the same order"):
        run_user_zero1(HangingZeRO1, nproc=2, steps=1, timeout=8)
