"""Fixture lab of module 09's "diagnose this run" cases (labkit.labs.diagnose): a run that grows
its micro-batch until the activations no longer fit, with the device memory emulated on CPU.

    torchrun --nproc-per-node 2 -m labkit.labs.diagnose.oom --budget 40000000
    labkit run labkit.labs.diagnose.oom -n 2 -- --batches 1,2,4,8 --budget 40000000

How the budget stands for a GPU's memory: `Budgeted`. The model and the precision are the
memory lab's, so what is counted matches labkit.memory.estimate_memory: docs/labs.md, ## diagnose.
"""
from __future__ import annotations

import argparse

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.flags import positive_int
from labkit.runtime import dist, measure


class Budgeted(measure.SavedActivations):
    """SavedActivations (the same accounting: unique storages, parameters excluded) that raises
    torch.OutOfMemoryError when `held` bytes of model states plus the activations saved so far
    would pass `budget`: what the CUDA caching allocator does when a forward runs out.

    Why: on CPU there is no CUDA out-of-memory error: the allocator takes what the machine has
    (and the kernel's OOM killer ends the process without a word when it runs out). So this lab
    gives each rank a budget of --budget bytes that stands for its GPU's memory, counts what a
    GPU would hold exactly as labkit.runtime.measure does (model states by storage, activations
    saved for backward as autograd saves them), and raises torch.OutOfMemoryError, as torch
    does on CUDA, at the first saved tensor that would take the rank past the budget, with the
    real numbers in the message."""

    def __init__(self, model, held: dict, budget: int, rank: int):
        super().__init__(model)
        self.held, self.budget, self.rank = held, budget, rank

    def _pack(self, t):
        before = self.bytes
        out = super()._pack(t)
        states = sum(self.held.values())
        if states + self.bytes > self.budget:
            asked = self.bytes - before
            in_use = states + before
            parts = ", ".join(f"{v:,} B {k}" for k, v in self.held.items())
            raise torch.OutOfMemoryError(
                f"out of memory (emulated on CPU: a budget of {self.budget:,} B stands for this "
                f"rank's GPU). Tried to allocate {asked:,} B for a tensor saved for backward; "
                f"rank {self.rank} holds {in_use:,} B: {parts}, {before:,} B of activations "
                f"saved for backward so far ({self.count - 1} tensors); "
                f"{max(0, self.budget - in_use):,} B free.")
        return out


def run(args, ctx) -> dict:
    from labkit.labs.common.models import MasterWeights, average_gradients, fused_dropout, lab_spec
    from labkit.labs.common.models import build_model

    spec = lab_spec(args)
    torch.manual_seed(args.seed)
    model = build_model(spec, "gelu_pytorch_tanh", torch.bfloat16, "eager").to(ctx.device)
    model.train()
    opt = MasterWeights(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(args.seed + 1000 * ctx.rank)
    steps = []
    for b in args.batches:
        states = measure.state_bytes(model, opt.optimizer)
        held = {"parameters": states.params, "gradients": states.grads,
                "optimizer states": states.optimizer_states}
        print(f"micro-batch {b} x {args.seq} tokens: holding {sum(held.values()):,} B of model "
              f"states; budget {args.budget:,} B", flush=True)
        dist.report(last_attempt=dict(batch=b, held=held))
        ids = torch.randint(0, spec.vocab_size, (b, args.seq), generator=gen).to(ctx.device)
        with fused_dropout():
            with Budgeted(model, held, args.budget, ctx.rank) as saved:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        average_gradients(model, ctx.world_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(dict(batch=b, held=held, activations=saved.bytes,
                          saved_tensors=saved.count, peak=sum(held.values()) + saved.bytes,
                          loss=loss.item()))
        print(f"micro-batch {b}: activations saved for backward {saved.bytes:,} B "
              f"({saved.count} tensors); peak {steps[-1]['peak']:,} B of {args.budget:,} B "
              f"({100 * steps[-1]['peak'] / args.budget:.0f}%); loss {loss.item():.4f}",
              flush=True)
        dist.report(steps=steps)
    return dict(rank=ctx.rank, world_size=ctx.world_size, budget=args.budget, seq=args.seq,
                layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                num_params=sum(p.numel() for p in model.parameters()), steps=steps)


def batches(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of micro-batch sizes; allowed: "
                                         "comma-separated whole numbers >= 1, e.g. 1,2,4,8")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=batches, default=[1, 2, 4, 8],
                   help="micro-batch of each step (default 1,2,4,8)")
    p.add_argument("--budget", type=positive_int, required=True,
                   help="bytes that stand for each rank's GPU memory")
    p.add_argument("--layers", type=positive_int, default=2, help="GPT-2 layers (default 2)")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary (default 1024)")
    p.add_argument("--seq", type=positive_int, default=256,
                   help="tokens per sequence (default 256)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"argument --heads: {args.heads} does not divide --hidden {args.hidden}; "
                f"allowed: a divisor of {args.hidden}")
    args.model, args.kv_heads = "debug-gpt2", args.heads       # what lab_spec reads
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = dist.setup()
    result = run(args, ctx)
    dist.report(**result)
    dist.shutdown()


if __name__ == "__main__":
    main()
