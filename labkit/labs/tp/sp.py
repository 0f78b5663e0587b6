"""--part sp of labkit.labs.tp: what sequence parallelism saves (activations) and what it trades
(communication), on the DTensor Llama of --part dtensor (labkit.labs.tp.dtensor) and on the
hand-built Megatron blocks (labkit.parallel.tensor.ParallelBlock).

    labkit run tp -n 2 -- --part sp                      # activations with and without SP

labkit.labs.tp.lab calls run_sp(args, ctx) and print_sp. Sources: Korthikanti et al. 2022,
§4.2.2, and Megatron-LM; why the activations' ratio is not 1.000 with SP: docs/labs.md, ## tp.
"""
from __future__ import annotations

import copy

import torch

from labkit.runtime import measure

FP32 = 4


def wire_bytes(by_kind: dict, n: int) -> float:
    """Bytes a rank sends for {kind: [calls, S bytes]} under the ring algorithms."""
    from labkit.comm import bytes_sent_per_rank

    return sum(bytes_sent_per_rank(k, b, n) for k, (_, b) in by_kind.items())


def one_pass(model, run, loss_of=None):
    """(bytes saved for backward while run() runs, {kind: [calls, bytes]} of the forward and
    backward); loss_of(run()) makes the loss outside the count (None: run() is the loss)."""
    from labkit.labs.tp.dtensor import tally

    counter = measure.CollectiveCounter()
    with counter:
        with measure.SavedActivations(model) as saved:
            out = run()
        (out if loss_of is None else loss_of(out)).backward()
    return saved.bytes, tally(counter.events)


def llama_rows(args, ctx) -> dict:
    from labkit.labs.tp.dtensor import build_llama, parallelize
    from labkit.labs.common.training import global_batch
    from labkit.memory import estimate_memory
    from torch.distributed.device_mesh import init_device_mesh

    base, spec = build_llama(args, ctx.device)
    n = ctx.world_size
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    ids = global_batch(args, 1, 0).to(ctx.device)
    pos = torch.arange(args.seq, device=ctx.device).unsqueeze(0)
    out = {}
    for plan in ("fused", "sp"):
        lm = parallelize(copy.deepcopy(base), plan, mesh)
        saved, comm = one_pass(lm, lambda: lm(input_ids=ids, position_ids=pos, labels=ids).loss)
        est = estimate_memory(spec, batch_size=args.batch, seq_len=args.seq, precision="fp32",
                              tp=n, sequence_parallel=plan == "sp",
                              implementation="hf-llama", attention="sdpa")
        # what these plans keep beyond the formula: the head is not vocab-parallel (each rank
        # keeps the whole fp32 log-softmax, not 1/tp of it); with SP, the gathered inputs of
        # the column Linears (after the 2 norms of each layer) and of the head, kept whole
        sbh, gathered = args.seq * args.batch * args.hidden, (2 * args.layers + 1)
        extra = FP32 * args.seq * args.batch * args.vocab * (n - 1) / n
        if plan == "sp":
            extra += gathered * FP32 * sbh * (n - 1) / n
        out[plan] = dict(measured=saved, predicted=est.activations, ratio=saved / est.activations,
                         predicted_kept_gathered=est.activations + extra,
                         ratio_kept_gathered=saved / (est.activations + extra),
                         collectives=comm, wire=wire_bytes(comm, n))
    return out


def block_rows(args, ctx) -> dict:
    from labkit import activations
    from labkit.labs.tp.block import block_input, build_blocks, parallel_blocks

    ref = build_blocks(args, ctx.device)
    x = block_input(args, ctx.device)
    out = {}
    for sp in (False, True):
        model = parallel_blocks(ref, sp)
        x_in = x.chunk(ctx.world_size, 0)[ctx.rank] if sp else x
        x_in = x_in.detach().clone().requires_grad_(True)
        saved, comm = one_pass(model, lambda: model(x_in), lambda y: y.pow(2).mean())
        terms = activations.layer_terms(
            "megatron", "sdpa", s=args.seq, b=args.batch, h=args.hidden, a=args.heads,
            ffn=4 * args.hidden, value_bytes=FP32, dropout=False, tp=ctx.world_size,
            sequence_parallel=sp)
        predicted = args.layers * sum(terms.values())
        kept = predicted + (args.layers * terms["qkv and mlp inputs"] * (ctx.world_size - 1)
                            if sp else 0)
        out["sp" if sp else "tp"] = dict(
            measured=saved, predicted=predicted, ratio=saved / predicted,
            predicted_kept_gathered=kept, ratio_kept_gathered=saved / kept,
            collectives=comm, wire=wire_bytes(comm, ctx.world_size))
    return out


def run_sp(args, ctx) -> dict:
    return dict(part="sp", rank=ctx.rank, world_size=ctx.world_size, layers=args.layers,
                hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq,
                llama=llama_rows(args, ctx), blocks=block_rows(args, ctx))


def print_sp(r: dict) -> None:
    n = r["world_size"]
    print(f"activations saved per rank (fp32), tp {n}, {r['layers']} layers, h {r['hidden']}, "
          f"batch {r['batch']} x {r['seq']} tokens; collectives of one forward + backward")
    for model in ("llama", "blocks"):
        for k, row in r[model].items():
            kinds = ", ".join(f"{op} {c}x" for op, (c, _) in row["collectives"].items())
            extra = (f"; keeping gathered inputs {row['ratio_kept_gathered']:.3f}"
                     if "ratio_kept_gathered" in row else "")
            print(f"  {model:<7}{k:<6}{row['measured']:>12,} B  predicted "
                  f"{row['predicted']:>12,.0f}  ratio {row['ratio']:.3f}{extra}")
            print(f"  {'':<13}{kinds}: ring wire bytes {row['wire']:,.0f}")
    print("  (ratio > 1 with SP: DTensor and the hand-built layers keep each column Linear's "
          "all-gathered input whole,\n   Megatron-LM keeps 1/tp and gathers it again in the "
          "backward; the Llama's head is not vocab-parallel: its fp32\n   log-softmax is whole "
          "on every rank. 'keeping gathered inputs' adds both to the formula)")
