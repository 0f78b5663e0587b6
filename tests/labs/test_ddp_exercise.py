"""Module 03's exercise runner (labkit.labs.ddp.exercise): a learner's DDP class or training step
reaches the ranks as source, runs beside torch's DistributedDataParallel and a single process,
and every usual mistake comes back as a sentence with its numbers."""
from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.comm import collective_time
from labkit.course import reference
from labkit.labs.ddp import exercise as dx
from labkit.labs.common import exercise as shared
from labkit.labs.ddp.exercise import run_user_ddp


# ----------------------------------------------------------------------- learners' answers

class GoodDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


class SumsDDP(GoodDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


class NoBroadcastDDP(GoodDDP):
    def __init__(self, module):
        nn.Module.__init__(self)
        self.module = module


class NoneGradDDP(GoodDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad)


class TiedTwiceDDP(GoodDDP):
    """Walks modules, so the tied embedding/head weight is all-reduced twice: right values,
    wrong bytes."""

    def finish_gradient_synchronization(self):
        for m in self.module.modules():
            for p in m.parameters(recurse=False):
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()


class SilentDDP(GoodDDP):
    def finish_gradient_synchronization(self):
        pass


class TorchsDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.inner = nn.parallel.DistributedDataParallel(module)
        self.module = module

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass


class HangingDDP(GoodDDP):
    """Rank 1 never reaches its all-reduces: rank 0 waits in its first one."""

    def finish_gradient_synchronization(self):
        if dist.get_rank() == 1:
            import time
            time.sleep(120)
        super().finish_gradient_synchronization()


class StubDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        raise NotImplementedError("Exercise naive_ddp: write ~3 lines")


class HalfStubDDP(GoodDDP):
    def finish_gradient_synchronization(self):
        raise NotImplementedError("Exercise naive_ddp: write ~5 lines")


def good_step(model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            (model(x, y) / k).backward()
    optimizer.step()


def plain_loop_step(model, optimizer, micro_batches):
    for x, y in micro_batches:
        (model(x, y) / len(micro_batches)).backward()
    optimizer.step()


def unscaled_step(model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == k - 1 else model.no_sync():
            model(x, y).backward()
    optimizer.step()


def never_syncs_step(model, optimizer, micro_batches):
    with model.no_sync():
        for x, y in micro_batches:
            (model(x, y) / len(micro_batches)).backward()
    optimizer.step()


def stub_step(model, optimizer, micro_batches):
    raise NotImplementedError("Exercise accumulate: write ~6 lines")


TRAINABLE = {id(p): p for p in dx.TinyLM().parameters() if p.requires_grad}
TRAINABLE_BYTES = sum(4 * p.numel() for p in TRAINABLE.values())      # fp32, tied once


# ---------------------------------------------------------------- the source, without ranks

def test_a_class_reaches_the_ranks_with_its_cell_minus_the_calls(tmp_path):
    """Imports, definitions and constants are kept; statements that call something (a launch, a
    print, an assignment from a call) would run again on every rank, and are dropped."""
    (tmp_path / "cell.py").write_text(
        "import torch\nfrom torch import nn\nWIDTH = 3\nSIZE = len('abc')\nprint('launched')\n"
        "class Wrapper(nn.Module):\n    def __init__(self, module):\n"
        "        super().__init__()\n        self.module = module  # kept\n\n"
        "    def width(self):\n        return WIDTH\n")
    spec = importlib.util.spec_from_file_location("cell", tmp_path / "cell.py")
    cell = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cell)
    src = shared.definition_source(cell.Wrapper)
    assert "print(" not in src and "SIZE" not in src
    assert "WIDTH = 3" in src and "# kept" in src and "from torch import nn" in src
    exported: dict = {}
    exec(compile(src, "<exported>", "exec"), exported)
    assert exported["Wrapper"](nn.Linear(1, 1)).width() == 3


def test_a_class_defined_inside_a_function_is_refused():
    class Inner(nn.Module):
        def forward(self, x):
            return x
    with pytest.raises(ValueError, match="top level of its cell"):
        shared.definition_source(Inner)


@pytest.mark.parametrize("obj, task", [(StubDDP, "wrapper"), (HalfStubDDP, "wrapper"),
                                       (stub_step, "accumulate")])
def test_a_stub_fails_at_once_without_ranks(obj, task):
    with pytest.raises(NotImplementedError, match=f"{obj.__name__} is not written yet"):
        run_user_ddp(obj, task=task)


@pytest.mark.parametrize("kwargs, words", [
    ({"task": "zero"}, "task='zero' is not supported; allowed: 'wrapper', 'accumulate'"),
    ({"nproc": 1}, "nproc=1 must be >= 2"),
    ({"steps": 0}, "steps=0 must be a whole number >= 1"),
    ({"task": "accumulate"}, "task='accumulate' takes a function; received <class"),
])
def test_bad_arguments_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        run_user_ddp(GoodDDP, **kwargs)


def test_the_references_are_the_formulas_they_stand_for():
    """The step-time check's reference is compute + each bucket's ring all-reduce, with buckets
    of bucket_size_mb MiB; the straggler's is 1 - 1/(1 + x)."""
    G, C, n, B, a = 7e9 * 2, 25 * 2**20, 64, 50e9, 2e-6
    k = -(-G // C)
    by_hand = 2.0 + (k - 1) * collective_time("all_reduce", C, n, B, a) \
        + collective_time("all_reduce", G - (k - 1) * C, n, B, a)
    got = reference.ddp_step_time(7e9, 64, B, a, 2.0, grad_bytes=2)
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert reference.throughput_loss(0.4) == pytest.approx(1 - 1 / 1.4, rel=1e-15)
    # torch's DistributedSampler pads by repeating from the start: 10 samples on 4 ranks
    assert [reference.sampler_indices(10, 4, r, shuffle=False) for r in range(4)] == \
        [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert reference.bucket_assignment([300, 500, 400, 100], 800 / 2**20) == [[3, 2], [1, 0]]


# ---------------------------------------------------------------------------- on real ranks

@pytest.mark.multirank
@pytest.mark.parametrize("nproc", [2, 4])
def test_a_correct_naive_ddp_equals_torch_ddp_and_sends_each_trainable_byte_once(nproc):
    r = run_user_ddp(GoodDDP, nproc=nproc)
    assert r.ok, r.summary()
    assert r.trainable_bytes == TRAINABLE_BYTES and r.trainable_tensors == len(TRAINABLE)
    # one all-reduce per trainable Parameter, the same bytes as torch's one bucket, every step
    assert r.all_reduces == [(len(TRAINABLE), TRAINABLE_BYTES)] * 3
    assert r.torch_all_reduces == [(1, TRAINABLE_BYTES)] * 3
    assert max(r.diff_ddp) < 1e-5 and max(r.diff_single) < 1e-5
    model = dx.TinyLM()          # one broadcast per parameter (tied once) and buffer
    assert r.construct_collectives["broadcast"][0] == len([*model.parameters(), *model.buffers()])


@pytest.mark.multirank
@pytest.mark.parametrize("cls, aspect, words", [
    (SumsDDP, "gradients", "yours / torch's = 2.000: the sum over 2 ranks, not the average; "
                           "divide by the world size"),
    (NoBroadcastDDP, "broadcast", "a rank's model differs from rank 0's by up to"),
    (NoBroadcastDDP, "gradients", "not compared: the replicas did not start equal"),
    (NoneGradDDP, "runs", "your NoneGradDDP raised TypeError"),
    (NoneGradDDP, "runs", "dist.all_reduce(p.grad)); parameters that do not require gradients "
                          "have p.grad None: skip them"),
    (TiedTwiceDDP, "bytes", "in 6 calls; the trainable parameters hold {trainable:,} B"),
    (SilentDDP, "gradients", "they are still each rank's own: nothing was all-reduced"),
    (SilentDDP, "bytes", "a step all-reduced 0 B in 0 calls"),
    (TorchsDDP, "runs", "your TorchsDDP wraps torch's DistributedDataParallel"),
])
def test_naive_ddp_mistakes_are_named_with_their_numbers(cls, aspect, words):
    r = run_user_ddp(cls, nproc=2, steps=2)
    assert not r.ok
    assert words.format(trainable=TRAINABLE_BYTES) in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()


@pytest.mark.multirank
def test_a_hang_is_stopped_and_explained():
    from labkit import LabError

    with pytest.raises(LabError, match="HangingDDP did not finish within 8 s on 2 ranks. A "
                                       "usual cause: the ranks did not issue the same "
                                       "collectives in the same order"):
        run_user_ddp(HangingDDP, nproc=2, steps=1, timeout=8)


@pytest.mark.multirank
def test_accumulation_with_no_sync_communicates_once_per_step():
    r = run_user_ddp(good_step, task="accumulate", nproc=2, micro=4)
    assert r.ok, r.summary()
    count, nbytes = r.per_backward
    assert count > 1 and nbytes == TRAINABLE_BYTES       # 4 KiB buckets: several all-reduces
    assert r.all_reduces == [(count, TRAINABLE_BYTES)] * 3
    assert max(r.diff_single) < 1e-5


@pytest.mark.multirank
@pytest.mark.parametrize("fn, aspect, words", [
    (plain_loop_step, "all_reduces", "issued {c4} all-reduces for 4 micro-batches; one "
                                     "synchronised backward issues {c} (torch DDP's buckets): "
                                     "{c4} = 4 x {c}: DDP all-reduces in every backward"),
    (unscaled_step, "parameters", "your update / the reference's = 4.000 (the 4 micro-batches' "
                                  "gradients summed, not averaged)"),
    (never_syncs_step, "all_reduces", "issued 0 all-reduces for 4 micro-batches"),
])
def test_accumulation_mistakes_are_named_with_their_numbers(fn, aspect, words):
    r = run_user_ddp(fn, task="accumulate", nproc=2, micro=4, steps=2)
    c = r.per_backward[0]
    assert not r.ok
    assert words.format(c=c, c4=4 * c) in r.verdicts()[aspect], r.summary()
