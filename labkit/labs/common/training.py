"""What every training lab shares: the debug GPT-2 that returns its loss (`CausalLM`, built the
same on every rank), the step's global batch and this rank's shard of it, one training step,
torch's DDP with torch 2.13's buffer flag, and the small timing helpers (barrier, device
synchronize, median).

Used by the ddp, zero, fsdp, tp, threed and diagnose labs: `from labkit.labs.common.training
import build_model, global_batch, shard`.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as tdist
from torch import nn


class CausalLM(nn.Module):
    """GPT-2 returning its loss: `model(ids)`. unused: an extra Linear the forward never uses
    (what find_unused_parameters is for); buffer: a float32 buffer of that many elements,
    updated by every forward (a token counter; what broadcast_buffers sends)."""

    def __init__(self, lm, unused: bool = False, buffer: int = 0):
        super().__init__()
        self.lm = lm
        if unused:
            self.unused = nn.Linear(8, 8)
        if buffer:
            self.register_buffer("seen", torch.zeros(buffer))

    def forward(self, ids):
        if hasattr(self, "seen"):
            self.seen += ids.numel()
        return self.lm(input_ids=ids, labels=ids).loss


def build_model(args, device="cpu", **extra) -> CausalLM:
    """The same GPT-2 on every rank (seeded): debug-gpt2 at the flags' sizes, no dropout."""
    import transformers

    from labkit.models import get_model

    transformers.logging.set_verbosity_error()
    spec = get_model("debug-gpt2").with_(
        num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.heads, ffn_size=4 * args.hidden, vocab_size=args.vocab,
        max_seq_len=max(args.seq, 64))
    config = spec.to_hf_config(activation_function="gelu_pytorch_tanh", resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(args.seed)
    model = CausalLM(transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa"),
                     **extra)
    assert sum(p.numel() for p in model.lm.parameters()) == spec.num_params()
    return model.to(device).train()


def global_batch(args, world: int, step: int) -> torch.Tensor:
    """Step `step`'s whole batch (world x --batch sequences), the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
    return torch.randint(0, args.vocab, (world * args.batch, args.seq), generator=gen)


def shard(ids: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's slice of the global batch, on its device."""
    b = ids.shape[0] // ctx.world_size
    return ids[ctx.rank * b:(ctx.rank + 1) * b].to(ctx.device)


def trainable(module) -> list:
    return [p for p in module.parameters() if p.requires_grad]


def train_step(model, opt, ids, sync=None, mark=None) -> float:
    """One step: forward, backward, `sync()` (a reference DDP's finish_gradient_synchronization;
    torch DDP synchronises inside backward), optimizer step. `mark(key)` records phase ends."""
    mark = mark or (lambda key: None)
    loss = model(ids)
    mark("forward_end")
    loss.backward()
    if sync is not None:
        sync()
    mark("sync_end")
    opt.step()
    opt.zero_grad()
    mark("step_end")
    return loss.item()


def barrier(ctx) -> None:
    if ctx.world_size > 1:
        tdist.barrier()


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA), so that a timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def torch_ddp(module, **kwargs):
    """torch's DDP; buffers are not re-broadcast before each forward unless asked
    (`forward_sync_buffers`, the name torch 2.13 gives `broadcast_buffers`; an older torch
    gets the old name)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    sync = kwargs.pop("forward_sync_buffers", False)
    new = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    kwargs["forward_sync_buffers" if new else "broadcast_buffers"] = sync
    return DistributedDataParallel(module, **kwargs)


def torch_buckets(ddp) -> list[int]:
    """The bucket sizes (bytes) torch's reducer uses now, from its logging data."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(x) for x in str(text).split(",") if x.strip()]
