"""Memory lab: train a small GPT-2 or Llama for a few steps, measure what it holds, compare.

    python -m labkit.labs.memory                                   # one process (CPU or 1 GPU)
    python -m labkit.labs.memory --model debug-llama               # a Llama (RMSNorm, SwiGLU, GQA)
    python -m labkit.labs.memory --precision fp32 --seq 256        # another policy, longer rows
    torchrun --nproc-per-node 2 -m labkit.labs.memory              # 2 data-parallel ranks
    labkit run memory -n 1 -- --precision bf16                     # the same, via labkit

From a notebook: `run_lab("labkit.labs.memory", nproc=1, args=["--precision", "fp32"])`.

What it measures on each rank, after the last step (exact, by deduplicated storage; PROBES.md):
- weights, gradients and optimizer states (`labkit.runtime.measure.state_bytes`); AdamW's 4-byte `step`
  tensor per parameter tensor is reported apart (`optimizer_steps`): labkit's formula leaves it
  out (it is a few hundred bytes, not a per-parameter cost);
- bytes saved for backward during the forward pass (`labkit.runtime.measure.SavedActivations`);
- peak CUDA memory when the rank has a GPU.
What it predicts: `labkit.memory.estimate_memory` for the same shape, batch, precision and
AdamW, built from the exact parameter count. Activations: for GPT-2 (`--model debug-gpt2`, the
default) Korthikanti et al.'s Megatron layer (implementation="megatron"), which the two choices
below make the model match; for `--model debug-llama` transformers' Llama as it is
(implementation="hf-llama", SDPA attention by default, `--attention eager` to keep the scores):
RMSNorm's fp32 copies, SwiGLU's four wide tensors, grouped-query K/V (`labkit.activations`). Each measured figure is printed beside its
prediction with the ratio, and reported (`labkit.runtime.dist.report`).

Precision policies (`--precision`, labkit's names):
- "bf16-mixed" (default): bf16 weights and gradients for forward and backward; the optimizer
  keeps an fp32 master copy of the weights and fp32 moments (2 + 2 + 12 = 16 bytes per
  parameter, as ZeRO counts it; Megatron-LM's bf16 default keeps fp32 gradients, 18 bytes).
  torch has no such optimizer, so this lab writes the 10 lines (`MasterWeights`).
- "fp32": everything in fp32 (4 + 4 + 8 = 16 bytes per parameter, the same total).
- "bf16": everything in bf16, moments too (2 + 2 + 4 = 8); what torch.optim does for bf16 params.
Activations are stored in the forward's dtype: bf16 for the bf16 policies, which is what the
Korthikanti et al. formula assumes (16-bit activations, 1-byte dropout masks); in fp32 4 bytes
per value (the masks stay 1 byte), which `estimate_memory(precision="fp32")` counts too.

For GPT-2, two choices make the model count what Megatron keeps, each with a flag to undo it
(with `--activation gelu_new` the prediction is transformers' GPT-2, implementation="hf-gpt2"):
- GELU: the formula assumes one GELU kernel that saves its input. transformers' GPT-2 default,
  "gelu_new", is the tanh approximation written as eight elementwise ops, several of which save
  their own 8*s*b*h-byte inputs (+29% activations with the default shape). The lab uses
  "gelu_pytorch_tanh", the same function in one kernel (`--activation gelu_new` to compare).
- Dropout: on CUDA, dropout is one fused kernel that saves a 1-byte bool mask. On CPU, torch's
  dropout is composite: it saves its random mask as a tensor of the input's dtype (2 bytes in
  bf16; +12% activations with the default shape). The lab routes dropout through
  `torch.native_dropout`, the fused kernel CUDA uses (it has a CPU version too), so a CPU run
  counts what a GPU run stores (`--cpu-dropout` to see torch's CPU default).
With --recompute full (transformers' activation checkpointing of every layer) the measurement
is about 5% above the formula here: each checkpointed layer keeps its inputs, and besides the
hidden states (2*s*b*h, counted) those include the b x 1 x s x s causal mask transformers builds
for eager attention (one tensor shared by all layers, b*s*s*2 bytes), which Megatron-LM never
materialises.
With several ranks, gradients are averaged with one all-reduce per tensor (plain data
parallelism: every rank holds everything, and every rank stores the activations of its own
micro-batch: data parallelism divides the batch, not a micro-batch's activations).
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.runtime import dist, measure
from labkit.memory import PRECISIONS, RECOMPUTE, estimate_memory
from labkit.models import get_model

TERMS = ("params", "grads", "optimizer_states", "model_states", "activations")


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


def implementation(spec, args) -> tuple[str, str]:
    """(implementation, attention) the prediction assumes: Megatron's for GPT-2 with one GELU
    kernel (what this lab builds by default), transformers' own otherwise."""
    attention = args.attention or ("eager" if spec.arch == "gpt2" else "sdpa")
    if spec.arch != "gpt2":
        return "hf-llama", attention
    return ("hf-gpt2" if args.activation == "gelu_new" else "megatron"), attention


def run(args, ctx) -> dict:
    torch.manual_seed(args.seed + ctx.rank)     # each rank its own data; same initial weights
    spec = lab_spec(args)
    impl, attention = implementation(spec, args)
    dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    torch.manual_seed(args.seed)
    model = build_model(spec, args.activation, dtype, attention).to(ctx.device)
    model.train()
    if args.recompute == "full":
        model.activation_checkpointing_enable({"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == spec.num_params(), (n_params, spec.num_params())

    if args.precision == "bf16-mixed":
        opt = MasterWeights(model.parameters(), lr=1e-3)
        inner = opt.optimizer
    else:
        opt = inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(args.seed + 1000 * ctx.rank)
    dropout = contextlib.nullcontext if args.cpu_dropout else fused_dropout
    measure.reset_peak_memory(ctx.device)
    losses = []
    for step in range(args.steps):
        ids = torch.randint(0, spec.vocab_size, (args.batch, args.seq), generator=gen)
        ids = ids.to(ctx.device)
        last = step == args.steps - 1
        # Backward too: full recompute re-runs the forward inside backward.
        with dropout():
            with measure.SavedActivations(model) as saved:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        average_gradients(model, ctx.world_size)
        opt.step()
        losses.append(loss.item())
        if last:     # measure before zero_grad: weights, gradients and states all alive
            # the fp32 master weights are what `inner` updates: state_bytes counts them as
            # optimizer state (they are not the model's parameters)
            states = measure.state_bytes(model, inner)
        opt.zero_grad(set_to_none=True)
        dist.progress(step + 1, args.steps, loss=losses[-1])

    measured = {"params": states.params, "grads": states.grads,
                "optimizer_states": states.optimizer_states,
                "activations": saved.bytes}
    measured["model_states"] = measured["params"] + measured["grads"] + \
        measured["optimizer_states"]
    est = estimate_memory(spec, batch_size=args.batch, seq_len=args.seq,
                          precision=args.precision, optimizer="adamw", recompute=args.recompute,
                          implementation=impl, attention=attention)
    predicted = {k: getattr(est, k) for k in TERMS}
    return dict(
        rank=ctx.rank, world_size=ctx.world_size, device=str(ctx.device), model=args.model,
        implementation=impl, attention=attention, kv_heads=spec.num_kv_heads,
        ffn=spec.ffn_size,
        precision=args.precision, recompute=args.recompute, activation=args.activation,
        cpu_dropout=args.cpu_dropout, num_params=n_params, num_param_tensors=len(list(
            model.parameters())), batch=args.batch, seq=args.seq, layers=args.layers,
        hidden=args.hidden, heads=args.heads, vocab=args.vocab,
        measured=measured, predicted=predicted,
        ratio={k: measured[k] / predicted[k] for k in TERMS},
        optimizer_steps=states.optimizer_steps,
        saved_by_dtype=dict(saved.by_dtype), saved_tensors=saved.count,
        peak_cuda=measure.peak_memory(ctx.device), predicted_total=est.total,
        losses=losses)


def print_table(r: dict) -> None:
    print(f"{r['model']} from config: {r['layers']} layers, hidden {r['hidden']}, {r['heads']} "
          f"heads ({r['kv_heads']} K/V), ffn {r['ffn']}, vocab {r['vocab']}: "
          f"{r['num_params']:,} parameters; {r['precision']} + AdamW, "
          f"micro-batch {r['batch']} x {r['seq']} tokens, recompute {r['recompute']}, "
          f"{r['world_size']} rank(s), {r['device']}; activations predicted for "
          f"implementation={r['implementation']!r}, attention={r['attention']!r}")
    print(f"{'term':<18}{'measured B':>14}{'predicted B':>14}{'ratio':>8}")
    for k in TERMS:
        print(f"{k:<18}{r['measured'][k]:>14,}{r['predicted'][k]:>14,.0f}{r['ratio'][k]:>8.3f}")
    print(f"(apart: AdamW's step counters, {r['num_param_tensors']} tensors x 4 B = "
          f"{r['optimizer_steps']:,} B)")
    if r["peak_cuda"] is not None:
        print(f"peak CUDA memory allocated: {r['peak_cuda']:,} B; predicted total (model states "
              f"+ activations, no temporaries): {r['predicted_total']:,.0f} B")


@record
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["debug-gpt2", "debug-llama"], default="debug-gpt2",
                   help="family and preset (default debug-gpt2; the flags below set its sizes)")
    p.add_argument("--attention", choices=["eager", "sdpa"], default=None,
                   help="attention kernel (default: eager for GPT-2, sdpa for Llama)")
    p.add_argument("--kv-heads", type=int, default=4,
                   help="Llama's key/value heads (default 4; must divide --heads)")
    p.add_argument("--precision", choices=[x for x in PRECISIONS if x != "fp16-mixed"],
                   default="bf16-mixed", help="labkit's policy name (default bf16-mixed)")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size h (default 128)")
    p.add_argument("--heads", type=int, default=8, help="attention heads a (default 8)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size v (default 1024)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence s (default 128)")
    p.add_argument("--batch", type=int, default=4, help="micro-batch b, per rank (default 4)")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--recompute", choices=[r for r in RECOMPUTE if r != "selective"],
                   default="none", help="full: HF gradient checkpointing of every layer")
    p.add_argument("--activation", default="gelu_pytorch_tanh",
                   choices=["gelu_pytorch_tanh", "gelu_new", "gelu"],
                   help="MLP activation (default: GPT-2's tanh GELU as one kernel)")
    p.add_argument("--cpu-dropout", action="store_true",
                   help="use torch's composite CPU dropout (mask in the activation dtype)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    ctx = dist.setup()
    result = run(args, ctx)
    if ctx.rank == 0:
        print_table(result)
    dist.report(**result)
    dist.shutdown()


if __name__ == "__main__":
    main()
