"""Fixture lab for tests/test_pipe.py: labkit.parallel.pipe against one process, on real ranks.

    torchrun --nproc-per-node 4 tests/labs/pipe_parity.py

Every rank builds the same model (same seed), keeps a single-process copy as the reference and
runs one step of GPipe and one of 1F1B on its stage. Reported per case and schedule:
`loss` (last rank: |pipeline - reference|), `grad` and `param` (max |difference| over this
stage's parameters, gradients and then parameters after one SGD step), `params` (how many
tensors this stage holds; `model_params`: the whole model), `peak_in_flight`, `peak_bytes`, `order` (this
stage's [kind, microbatch] in time order), `p2p`. `sleep`: per schedule, every rank's events of
a step of SleepLayer stages (forward SLEEP s, backward 2 SLEEP s) and compare_events' figures
against the simulator.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from labkit.models import get_model
from labkit.parallel import pipe
from labkit.pipeline import simulate
from labkit.runtime import dist

BATCH, SEQ, H, VOCAB, LAYERS = 8, 8, 16, 64, 4     # LAYERS blocks: 2 or 4 stages divide them
M = 4                                              # micro-batches for the parity cases
SLEEP_M, SLEEP = 8, 0.03                           # the timeline case: p=4, m=8 as in PROBES
LR = 0.1
STEPS = {"gpipe": pipe.gpipe_step, "1f1b": pipe.one_f_one_b_step}


def block_stack():
    """A plain residual block stack in float64 (parity to rounding, ~1e-16)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(H, H, dtype=torch.float64)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    return [Block() for _ in range(LAYERS)]


def llama():
    spec = get_model("debug-llama").with_(hidden_size=32, num_heads=4, num_kv_heads=2,
                                          ffn_size=64, vocab_size=VOCAB, num_layers=LAYERS)
    from labkit.labs.memory import build_model
    return build_model(spec, "silu", torch.float32, "sdpa")


def gpt2():
    import transformers
    spec = get_model("debug-gpt2").with_(tied_embeddings=False, hidden_size=32, num_heads=4,
                                         num_kv_heads=4, ffn_size=128, vocab_size=VOCAB,
                                         num_layers=LAYERS)
    config = spec.to_hf_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")


def reference_step(model, inputs, targets, loss_fn):
    """The single-process step: the full batch's loss, backward, SGD."""
    if loss_fn is None:
        loss = model(inputs, labels=targets).loss             # transformers' own loss
    else:
        x = inputs
        for block in model:
            x = block(x)
        loss = loss_fn(x, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in named(model)}
    torch.optim.SGD([p for _, p in named(model)], lr=LR).step()
    return loss.detach(), grads


def named(model):
    return (nn.ModuleList(model) if isinstance(model, list) else model).named_parameters()


def parity(ctx, build, inputs, targets, loss_fn, schedule):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    ref_loss, ref_grads = reference_step(ref, inputs, targets, loss_fn)
    name_of = {id(p): n for n, p in named(model)}
    stage = pipe.split_model(model, ctx.world_size)[ctx.rank]
    loss, stats = STEPS[schedule](stage, pipe.split_batch(inputs, targets, M), rank=ctx.rank,
                                  world=ctx.world_size, loss_fn=loss_fn)
    mine = [(name_of[id(p)], p) for p in stage.parameters()]
    grad = max((p.grad - ref_grads[n]).abs().max().item() for n, p in mine)
    torch.optim.SGD([p for _, p in mine], lr=LR).step()
    ref_params = dict(named(ref))
    param = max((p - ref_params[n]).abs().max().item() for n, p in mine)
    return {"loss": None if loss is None else abs(loss.item() - ref_loss.item()),
            "has_loss": loss is not None, "grad": grad, "param": param, "params": len(mine),
            "model_params": len(ref_params),
            "peak_in_flight": stats["peak_in_flight"], "p2p": stats["p2p"],
            "peak_bytes": stats["peak_activation_bytes"],
            "order": [[e["kind"], e["microbatch"]] for e in stats["events"]]}


def sleep_timeline(ctx, schedule):
    """One step of SleepLayer stages; every rank's events and the simulated idle share."""
    stage = pipe.split_model([pipe.SleepLayer(SLEEP) for _ in range(ctx.world_size)],
                             ctx.world_size)[ctx.rank]
    x = torch.ones(SLEEP_M, 2)
    _, stats = STEPS[schedule](stage, pipe.split_batch(x, x, SLEEP_M), rank=ctx.rank,
                               world=ctx.world_size, loss_fn=lambda out, t: (out * t).sum())
    events = pipe.gather_events(stats)
    sim = simulate(schedule, ctx.world_size, SLEEP_M, fwd=SLEEP, bwd=2 * SLEEP)
    return {"events": events, "compare": pipe.compare_events(events, sim),
            "peak_in_flight": stats["peak_in_flight"]}


def main():
    ctx = dist.setup("gloo")
    data = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, H, generator=data, dtype=torch.float64)
    y = torch.randn(BATCH, H, generator=data, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
    out = {"world_size": ctx.world_size}
    for schedule in STEPS:
        out[f"blocks_{schedule}"] = parity(ctx, block_stack, x, y, F.mse_loss, schedule)
        out[f"llama_{schedule}"] = parity(ctx, llama, ids, ids, None, schedule)
    out["gpt2_1f1b"] = parity(ctx, gpt2, ids, ids, None, "1f1b")
    out["sleep"] = {schedule: sleep_timeline(ctx, schedule) for schedule in STEPS}
    dist.report(**out)
    dist.shutdown()


if __name__ == "__main__":
    main()
