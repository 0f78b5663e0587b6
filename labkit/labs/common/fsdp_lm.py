"""The FSDP2-sharded transformers language model that the checkpoint (crash and resume) and DCP
labs train: its flags and their checks, the model built and sharded per block then at the root,
and each step's batch, the same on every world size.
"""
from __future__ import annotations

import argparse

import torch

from labkit.labs.common.flags import positive_int


MODELS = {"llama": "debug-llama", "gpt2": "debug-gpt2"}


CONFIG = ("model", "layers", "hidden", "heads", "vocab", "seq", "global_batch", "lr", "seed")


def spec_of(args):
    """The model of the flags: debug-llama (ffn 2h, half the heads for key/value) or
    debug-gpt2 (ffn 4h) at these sizes."""
    from labkit.models import get_model
    base = get_model(MODELS[args.model])
    llama = base.arch == "llama"
    return base.with_(name=f"crash-{args.model}", num_layers=args.layers,
                      hidden_size=args.hidden, num_heads=args.heads,
                      num_kv_heads=args.heads // 2 if llama else args.heads,
                      ffn_size=(2 if llama else 4) * args.hidden, vocab_size=args.vocab,
                      max_seq_len=max(args.seq, 64))


def build(args):
    """The transformers model of the flags with the same random weights on every rank, no
    dropout (a step is then a function of the weights and the data alone)."""
    from labkit.labs.common.models import build_model
    torch.manual_seed(args.seed)
    model = build_model(spec_of(args), "gelu_pytorch_tanh", torch.float32, "sdpa")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.train()


def batch(args, step: int, ctx) -> torch.Tensor:
    """This rank's share of step `step`'s global batch, drawn from a seed of the step alone:
    sequences that count up from a random token by a random stride of 1 to 4 (mod the
    vocabulary), something a small model learns in a few steps, so the loss curve falls."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    start = torch.randint(0, args.vocab, (args.global_batch, 1), generator=gen)
    stride = torch.randint(1, 5, (args.global_batch, 1), generator=gen)
    ids = (start + stride * torch.arange(args.seq)) % args.vocab
    b = args.global_batch // ctx.world_size
    return ids[ctx.rank * b:(ctx.rank + 1) * b].to(ctx.device)


def model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the model, the data and the optimizer (shared with labkit.labs.dcp)."""
    p.add_argument("--model", choices=sorted(MODELS), default="llama",
                   help="transformers model built from a config (default llama)")
    p.add_argument("--layers", type=positive_int, default=2, help="blocks (default 2)")
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=positive_int, default=512, help="vocabulary (default 512)")
    p.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--global-batch", type=positive_int, default=8,
                   help="sequences per step over all ranks (default 8; a multiple of the ranks)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and data (default 0)")


def check_model_flags(p: argparse.ArgumentParser, args) -> None:
    if args.hidden % args.heads or (args.model == "llama" and args.heads % 2):
        p.error(f"argument --heads: {args.heads} must divide --hidden {args.hidden}"
                f"{' and be even (key/value heads are half)' if args.model == 'llama' else ''}")
    if not (0 < args.lr < 1):
        p.error(f"argument --lr: {args.lr} is not a learning rate; allowed: 0 < lr < 1")


def check_world(args, ctx) -> None:
    """The global batch must split evenly across this run's ranks."""
    if args.global_batch % ctx.world_size:
        raise ValueError(f"--global-batch {args.global_batch} does not split across "
                         f"{ctx.world_size} ranks; allowed: a multiple of {ctx.world_size}")


def sharded(args):
    """(model, AdamW): the flags' model, sharded with FSDP2 per block then the root."""
    from labkit.parallel.fsdp import shard_model
    model = shard_model(build(args))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def killed_rank(rank, flag: str, at_step, ctx) -> int:
    """The rank a --crash/--kill run kills: `rank`, or the last one (ValueError if no rank of
    this run)."""
    rank = ctx.world_size - 1 if rank is None else rank
    if at_step is not None and rank >= ctx.world_size:
        raise ValueError(f"{flag} {rank} is not a rank of this run; allowed: 0 to "
                         f"{ctx.world_size - 1}")
    return rank


def finish_step(loss, opt, ctx) -> float:
    """Backward, the optimizer's step, and the loss averaged over the ranks (what the crash and
    elastic labs record for each step)."""
    import torch.distributed as tdist
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    tdist.all_reduce(mean)
    return (mean / ctx.world_size).item()
