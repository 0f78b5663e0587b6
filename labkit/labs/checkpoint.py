"""Crash lab: train with FSDP2, checkpoint every K steps, kill a rank, resume: the same losses.

    labkit run checkpoint -n 4 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck              # clean
    labkit run checkpoint -n 4 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck2 --crash-at-step 5
    labkit run checkpoint -n 4 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck2 --resume
    labkit run checkpoint -n 2 -- --steps 8 --save-every 2 --ckpt-dir /tmp/ck2 --resume  # 4 -> 2

From a notebook: `run_lab("labkit.labs.checkpoint", nproc=4, args=[...])`; the crash run raises
LabError naming the killed rank and its signal (SIGKILL); `err.result.results[0]["losses"]`
still holds what rank 0 reported before the crash.

A transformers Llama (or GPT-2, --model gpt2; no dropout) built from a config is sharded with
FSDP2 (labkit.parallel.fsdp.shard_model: per block, then the root) and trained with AdamW.
Step t (1, 2, ..., --steps) trains on a global batch of --global-batch sequences drawn from a
seed of t alone and split evenly across the ranks, so the run does not depend on the world size
except through the order of the sums (the gradient and the loss are means over the whole
global batch on any world size). After step t, if t is a multiple of --save-every, every rank
saves its shards with labkit.parallel.checkpoint.save (DCP) as ckpt-dir/step_00000t.
--crash-at-step S: rank --crash-rank (default: the last) kills itself with SIGKILL during step
S, right after its forward: its peers are in the backward's collectives when it dies.
--resume: load the newest complete checkpoint (labkit.parallel.checkpoint.latest) and go on from
the step after it; the losses saved with it come first in the report.

Reported on rank 0 (labkit.runtime.dist.report, after every step): `losses` ([step, loss] for
every step, the loss averaged over the global batch), `saves` (steps checkpointed by this run),
`resumed_from` (the checkpoint's step, or None), `world_size`, `num_params`.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.ddp import positive_int
from labkit.parallel import checkpoint
from labkit.runtime import dist

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
    from labkit.labs.memory import build_model
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


def config(args) -> dict:
    return {k: getattr(args, k) for k in CONFIG}


def resume(args, model, opt) -> tuple[int, list]:
    """(step, losses) of the newest complete checkpoint, loaded into model and opt."""
    found = checkpoint.latest(args.ckpt_dir)
    if found is None:          # parse_args checked it, but a rank may race a deletion
        raise FileNotFoundError(f"--resume: no complete checkpoint in {args.ckpt_dir!r}")
    saved = checkpoint.info(found[1])["extra"]
    if saved.get("config") != config(args):
        diff = {k: (saved.get("config", {}).get(k), v) for k, v in config(args).items()
                if saved.get("config", {}).get(k) != v}
        raise ValueError(f"--resume: the checkpoint {found[1]!r} was saved by a run with other "
                         f"flags ({', '.join(f'{k}: saved {a!r}, now {b!r}' for k, (a, b) in diff.items())}); "
                         "allowed: the same flags (the world size may differ)")
    step = checkpoint.load(model, opt, found[1])
    return step, [list(x) for x in saved["losses"]]


def run(args, ctx) -> dict:
    check_world(args, ctx)
    crash_rank = ctx.world_size - 1 if args.crash_rank is None else args.crash_rank
    if args.crash_at_step is not None and crash_rank >= ctx.world_size:
        raise ValueError(f"--crash-rank {crash_rank} is not a rank of this run; allowed: 0 to "
                         f"{ctx.world_size - 1}")
    model, opt = sharded(args)
    n_params = sum(p.numel() for p in model.parameters())
    start, losses, saves = 0, [], []
    if args.resume:
        start, losses = resume(args, model, opt)
        dist.print0(f"resumed from step {start} (saved by "
                    f"{checkpoint.info(checkpoint.step_dir(args.ckpt_dir, start))['world_size']}"
                    f" ranks) on {ctx.world_size} ranks")
    out = {"world_size": ctx.world_size, "num_params": n_params, "resumed_from":
           start if args.resume else None, "saves": saves, "losses": losses}
    for step in range(start + 1, args.steps + 1):
        loss = model(input_ids=batch(args, step, ctx), labels=batch(args, step, ctx)).loss
        if step == args.crash_at_step and ctx.rank == crash_rank:
            print(f"rank {ctx.rank}: killing myself with SIGKILL at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append([step, (mean / ctx.world_size).item()])
        if args.ckpt_dir and step % args.save_every == 0:
            checkpoint.save(model, opt, step, args.ckpt_dir,
                            extra={"losses": losses, "config": config(args)})
            saves.append(step)
        dist.progress(step, args.steps, loss=losses[-1][1])
        if ctx.rank == 0:
            dist.report(**out)
    return out


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=positive_int, default=8, help="steps in all (default 8)")
    p.add_argument("--save-every", type=positive_int, default=None,
                   help="checkpoint after every K-th step (default 2 with --ckpt-dir)")
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints go (default: none saved)")
    p.add_argument("--crash-at-step", type=positive_int, default=None,
                   help="kill --crash-rank with SIGKILL during this step, after its forward")
    p.add_argument("--crash-rank", type=int, default=None,
                   help="the rank killed (default: the last rank)")
    p.add_argument("--resume", action="store_true",
                   help="load the newest complete checkpoint in --ckpt-dir and go on")
    model_flags(p)
    args = p.parse_args(argv)
    check_model_flags(p, args)
    if args.crash_at_step is not None and args.crash_at_step > args.steps:
        p.error(f"argument --crash-at-step: {args.crash_at_step} is after the last step; "
                f"allowed: 1 to --steps ({args.steps})")
    if args.crash_rank is not None and args.crash_rank < 0:
        p.error(f"argument --crash-rank: {args.crash_rank} is not a rank; allowed: 0 or more")
    if args.ckpt_dir is None and (args.resume or args.save_every is not None):
        p.error("argument --ckpt-dir: needed by --resume and --save-every; allowed: a folder")
    if args.save_every is None:
        args.save_every = 2
    if args.resume:
        found = checkpoint.latest(args.ckpt_dir)
        if found is None:
            p.error(f"argument --resume: no complete checkpoint in {args.ckpt_dir!r} (a "
                    "step_XXXXXX folder with .metadata and labkit.json); run without --resume "
                    "first, with --save-every K smaller than the crash step")
        if found[0] >= args.steps:
            p.error(f"argument --steps: {args.steps} steps are done already (the checkpoint is "
                    f"of step {found[0]}); allowed: more than {found[0]}")
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = dist.setup()
    run(args, ctx)
    dist.shutdown()


if __name__ == "__main__":
    main()
