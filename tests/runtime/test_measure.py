"""labkit.runtime.measure: exact bytes of model states, saved activations and collectives.

In-process tests need no process group (or a one-rank one); one 4-rank launch measures DDP and
FSDP2 (tests/fixtures/labs/measure_lab.py) and the multirank tests read its reports.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from labkit.runtime import measure

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"


def linear_stack(dims, relu=True):
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if relu and i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("input_grad", [True, False])
def test_saved_activations_of_a_linear_stack_are_the_analytic_count(relu, input_grad):
    # Each Linear saves its input (for the weight gradient); a ReLU saves its output, which is
    # the next Linear's input (one storage, counted once). Weights (and weight.t()) are excluded.
    batch, dims = 8, [16, 32, 24, 8]
    model = linear_stack(dims, relu)
    x = torch.randn(batch, dims[0], requires_grad=input_grad)
    with measure.SavedActivations(model) as saved:
        model(x).sum()
    assert saved.bytes == 4 * batch * sum(dims[:-1])
    assert saved.count == len(dims) - 1 and saved.by_dtype == {"float32": saved.bytes}


def test_saved_activations_follow_the_dtype_and_recomputation():
    model = linear_stack([16, 16, 16]).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with measure.SavedActivations(model) as saved:
        model(x).sum()
    assert saved.bytes == 2 * 4 * 32
    from torch.utils.checkpoint import checkpoint
    with measure.SavedActivations(model) as ckpt:
        checkpoint(model, x, use_reentrant=False).sum()
    assert ckpt.bytes < saved.bytes    # only the checkpoint's input is kept


def test_state_bytes_with_adamw():
    model = linear_stack([16, 32, 8])
    opt = torch.optim.AdamW(model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    assert measure.state_bytes(model, opt) == measure.StateBytes(4 * n_params, 0, 0, 0)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    s = measure.state_bytes(model, opt)
    n_tensors = len(list(model.parameters()))
    assert (s.params, s.grads, s.optimizer_states, s.optimizer_steps) == (
        4 * n_params, 4 * n_params, 8 * n_params, 4 * n_tensors)
    assert s.total == 16 * n_params + 4 * n_tensors


def test_state_bytes_deduplicates_tied_weights():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleList([emb, head])
    assert measure.state_bytes(model).params == 4 * 40


def test_collective_counter_on_one_rank():
    import torch.distributed as tdist
    import torch.distributed._functional_collectives as fc

    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(100)
        with measure.CollectiveCounter() as comm:
            tdist.all_reduce(t)
            tdist.all_reduce(t)
            tdist.broadcast(t, src=0)
            out = torch.empty(100)
            gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
            gather(out, t)
            fc.all_reduce(t, "sum", tdist.group.WORLD).wait()
            tdist.barrier()
        assert comm.by_kind == {"all_reduce": (3, 1200), "all_gather": (1, 400),
                                "barrier": (1, 0), "broadcast": (1, 400)}
        assert comm.total_bytes == 2000
        assert {e.dtype for e in comm.events if e.bytes} == {"float32"}
    finally:
        tdist.destroy_process_group()


def test_step_timer_leaves_out_warmup():
    import time
    timer = measure.StepTimer(warmup=1)
    for d in (0.05, 0.01, 0.01):
        with timer:
            time.sleep(d)
    assert len(timer.all_times) == 3 and len(timer.times) == 2
    assert timer.mean < 0.04 and timer.summary()["steps"] == 2


def test_peak_memory_is_none_on_cpu():
    if not torch.cuda.is_available():
        assert measure.peak_memory() is None


@pytest.fixture(scope="module")
def measured():
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "measure_lab.py", nproc=4, timeout=180, quiet=True).results


@pytest.mark.multirank
def test_ddp_all_reduce_bytes_sum_to_gradient_bytes(measured):
    for r in measured:
        count, nbytes = r["ddp_all_reduce"]
        assert count >= 1 and nbytes == r["ddp_grad_bytes"] == r["ddp_param_bytes"]


@pytest.mark.multirank
def test_fsdp2_local_parameter_bytes_are_full_over_n(measured):
    for r in measured:
        n, full = r["world_size"], r["fsdp_full_param_bytes"]
        # dims divide by 4 here, so no padding: exactly full / N (padding would add < 4 bytes
        # per row of each parameter's dim 0)
        assert r["fsdp_local_param_bytes"] == full // n
        assert r["fsdp_local_grad_bytes"] == full // n
        assert r["fsdp_local_optimizer_bytes"] == 2 * full // n
        # one step with reshard-after-forward: all-gather forward and backward, one reduce-scatter
        assert r["fsdp_by_kind"]["all_gather"][1] == 2 * full
        assert r["fsdp_by_kind"]["reduce_scatter"][1] == full


@pytest.mark.multirank
def test_functional_all_gather_counts_the_gathered_bytes(measured):
    for r in measured:   # 8 fp32 values from each of N ranks: 32 * N bytes gathered
        assert r["funcol_by_kind"]["all_gather"] == [1, 32 * r["world_size"]]
