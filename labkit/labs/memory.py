"""Memory lab: train a small GPT-2 or Llama for a few steps, measure what it holds, compare.

    python -m labkit.labs.memory                                   # one process (CPU or 1 GPU)
    python -m labkit.labs.memory --model debug-llama               # a Llama (RMSNorm, SwiGLU, GQA)
    python -m labkit.labs.memory --precision fp32 --seq 256        # another policy, longer rows
    torchrun --nproc-per-node 2 -m labkit.labs.memory              # 2 data-parallel ranks
    labkit run memory -n 1 -- --precision bf16                     # the same, via labkit

From a notebook: `run_lab("labkit.labs.memory", nproc=1, args=["--precision", "fp32"])`.
Measured per rank (PROBES.md) beside labkit.memory.estimate_memory (Korthikanti et al. 2022);
what each figure is, the precision policies and the GPT-2 choices: docs/labs.md, ## memory.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.labs.common.flags import positive_int
from labkit.runtime import dist, measure
from labkit.memory import PRECISIONS, RECOMPUTE, estimate_memory
from labkit.labs.common.models import MasterWeights, average_gradients, build_model, fused_dropout, lab_spec

TERMS = ("params", "grads", "optimizer_states", "model_states", "activations")



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
    # predicted for this device's kernels: on a CPU, SDPA with dropout runs its math path, and
    # F.dropout keeps a mask in the dtype unless the fused kernel is swapped in (the default)
    kernels = dict(device=ctx.device.type,
                   fused_dropout=ctx.device.type == "cuda" or not args.cpu_dropout)
    est = estimate_memory(spec, batch_size=args.batch, seq_len=args.seq,
                          precision=args.precision, optimizer="adamw", recompute=args.recompute,
                          implementation=impl, attention=attention, **kernels)
    predicted = {k: getattr(est, k) for k in TERMS}
    return dict(
        rank=ctx.rank, world_size=ctx.world_size, device=str(ctx.device), model=args.model,
        implementation=impl, attention=attention, kernel=est.inputs["attention"],
        kernels=kernels, kv_heads=spec.num_kv_heads,
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
          f"implementation={r['implementation']!r}, attention={r['attention']!r} (runs as "
          f"{r['kernel']!r} on {r['kernels']['device']}; dropout "
          f"{'fused, 1-byte masks' if r['kernels']['fused_dropout'] else 'masks in the dtype'})")
    print(f"{'term':<18}{'measured B':>14}{'predicted B':>14}{'ratio':>8}")
    for k in TERMS:
        print(f"{k:<18}{r['measured'][k]:>14,}{r['predicted'][k]:>14,.0f}{r['ratio'][k]:>8.3f}")
    print(f"(apart: AdamW's step counters, {r['num_param_tensors']} tensors x 4 B = "
          f"{r['optimizer_steps']:,} B)")
    if r["peak_cuda"] is not None:
        print(f"peak CUDA memory allocated: {r['peak_cuda']:,} B; predicted total (model states "
              f"+ activations, no temporaries): {r['predicted_total']:,.0f} B")


# the spec's field in its errors -> the flag that sets it
FIELDS = {"num_layers": "--layers", "hidden_size": "--hidden", "num_heads": "--heads",
          "num_kv_heads": "--kv-heads", "vocab_size": "--vocab", "max_seq_len": "--seq"}


def parse_args(argv=None):
    """The flags, each refused with its name and what is allowed before any work."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["debug-gpt2", "debug-llama"], default="debug-gpt2",
                   help="family and preset (default debug-gpt2; the flags below set its sizes)")
    p.add_argument("--attention", choices=["eager", "sdpa"], default=None,
                   help="attention kernel (default: eager for GPT-2, sdpa for Llama)")
    p.add_argument("--kv-heads", type=positive_int, default=4,
                   help="Llama's key/value heads (default 4; must divide --heads)")
    p.add_argument("--precision", choices=[x for x in PRECISIONS if x != "fp16-mixed"],
                   default="bf16-mixed", help="labkit's policy name (default bf16-mixed)")
    p.add_argument("--layers", type=positive_int, default=4, help="transformer layers (default 4)")
    p.add_argument("--hidden", type=positive_int, default=128, help="hidden size h (default 128)")
    p.add_argument("--heads", type=positive_int, default=8, help="attention heads a (default 8)")
    p.add_argument("--vocab", type=positive_int, default=1024,
                   help="vocabulary size v (default 1024)")
    p.add_argument("--seq", type=positive_int, default=128,
                   help="tokens per sequence s (default 128)")
    p.add_argument("--batch", type=positive_int, default=4,
                   help="micro-batch b, per rank (default 4)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    p.add_argument("--recompute", choices=[r for r in RECOMPUTE if r != "selective"],
                   default="none", help="full: HF gradient checkpointing of every layer")
    p.add_argument("--activation", default="gelu_pytorch_tanh",
                   choices=["gelu_pytorch_tanh", "gelu_new", "gelu"],
                   help="MLP activation (default: GPT-2's tanh GELU as one kernel)")
    p.add_argument("--cpu-dropout", action="store_true",
                   help="use torch's composite CPU dropout (mask in the activation dtype; the "
                        "prediction follows)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        lab_spec(args)
    except ValueError as exc:       # the spec's own checks, in the flags' names
        field, _, text = str(exc).partition("=")
        value, _, text = text.partition(" ")
        for name, flag in FIELDS.items():
            text = text.replace(f"{name}=", f"{flag} ")
        p.error(f"argument {FIELDS.get(field, field)}: {value} {text}")
    if args.model == "debug-llama" and args.hidden // args.heads % 2:
        p.error(f"argument --heads: {args.heads} makes an odd head size, --hidden {args.hidden} "
                f"/ {args.heads} = {args.hidden // args.heads}, which RoPE refuses; allowed: "
                "heads that leave an even head size")
    return args


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    ctx = dist.setup()
    result = run(args, ctx)
    if ctx.rank == 0:
        print_table(result)
    dist.report(**result)
    dist.shutdown()


if __name__ == "__main__":
    main()
