"""transformers models built from a labkit ModelSpec, as the memory lab measures them and other
labs reuse them: `build_model(spec, activation, dtype, attention)`, the lab's spec from its flags
(`lab_spec`), fp32 master weights beside bf16 parameters (`MasterWeights`), a plain gradient
average (`average_gradients`) and `fused_dropout` (torch's fused dropout kernel, as real runs use).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist

from labkit.models import get_model


@contextlib.contextmanager
def fused_dropout():
    """Inside the block, `F.dropout` runs as `torch.native_dropout`: the fused kernel that keeps a
    1-byte bool mask (what CUDA always runs; on CPU torch otherwise saves its mask in the
    input's dtype). A swap of the function, not a TorchFunctionMode: full recompute re-runs the
    forward inside backward, where a mode entered around the forward is no longer active."""
    F = torch.nn.functional
    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


class MasterWeights:
    """Mixed precision as ZeRO counts it (2 + 2 + 12): the model computes in bf16; the
    optimizer updates an fp32 copy of every weight (the master weights) and copies it back.

    The fp32 gradient each master weight needs exists only inside `step()` (a temporary
    buffer, freed before the step returns), so between steps a parameter costs 2 (bf16 weight) +
    2 (bf16 gradient) + 4 (fp32 master) + 8 (fp32 moments) = 16 bytes."""

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.optimizer = optimizer_cls(self.master, **kwargs)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)             # round to bf16 for the next forward
            m.grad = None          # the fp32 gradient was a temporary

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def master_bytes(self) -> int:
        return sum(m.untyped_storage().nbytes() for m in self.master)


def average_gradients(model, world_size: int) -> None:
    """Plain data parallelism after backward: every gradient all-reduced and divided by the
    world size (gloo has no average); nothing with one rank."""
    if world_size > 1:
        for p in model.parameters():
            tdist.all_reduce(p.grad)
            p.grad /= world_size


def build_model(spec, activation: str, dtype, attention: str = "eager"):
    """A transformers GPT2LMHeadModel or LlamaForCausalLM with random weights from `spec`
    (nothing downloaded). GPT-2 defaults to eager attention: Megatron's formula counts the s x s
    attention scores that a fused attention kernel (SDPA, FlashAttention) would not store."""
    import transformers

    transformers.logging.set_verbosity_error()   # not its notice that the config has no loss_type
    if spec.arch == "gpt2":
        config = spec.to_hf_config(activation_function=activation)
        cls = transformers.GPT2LMHeadModel
    else:
        config, cls = spec.to_hf_config(), transformers.LlamaForCausalLM
    model = cls._from_config(config, attn_implementation=attention)
    return model.to(dtype)


def lab_spec(args):
    """The lab's model: the --model preset at the sizes the flags give (GPT-2: ffn 4h; Llama:
    ffn 2h and --kv-heads key/value heads, as debug-llama)."""
    base = get_model(args.model)
    gpt2 = base.arch == "gpt2"
    return base.with_(
        name=f"lab-{base.arch}", num_layers=args.layers, hidden_size=args.hidden,
        num_heads=args.heads, num_kv_heads=args.heads if gpt2 else args.kv_heads,
        ffn_size=(4 if gpt2 else 2) * args.hidden, vocab_size=args.vocab,
        max_seq_len=max(args.seq, 256))
