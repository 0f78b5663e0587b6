"""--part block and --part pitfall of labkit.labs.tp: the hand-built Megatron layers
(labkit.parallel.tensor) against one device with the same weights.

    labkit run tp -n 2                                   # --part block: hand-built vs 1 device
    labkit run tp -n 4 -- --part block --sequence-parallel
    labkit run tp -n 2 -- --part pitfall                 # dist.all_gather's wrong gradients

labkit.labs.tp.lab calls run_block / run_pitfall (args, ctx) and print_block / print_pitfall.
Sources: Shoeybi et al. 2019, §3 (f and g); Korthikanti et al. 2022 (sequence parallelism).
What each compares, and the four gathers of the pitfall: docs/labs.md, ## tp.
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from labkit.runtime import measure

PITFALLS = ("dist.all_gather", "tdnn.all_gather", "tdnn.all_gather, loss / tp, f",
            "gather (Megatron)")


def build_blocks(args, device) -> nn.Sequential:
    """--layers single-device Blocks (h, heads, ffn 4h), seeded: the same on every rank."""
    from labkit.parallel.tensor import Block

    torch.manual_seed(args.seed)
    return nn.Sequential(*[Block(args.hidden, args.heads, 4 * args.hidden)
                           for _ in range(args.layers)]).to(device)


def block_input(args, device, salt: int = 1) -> torch.Tensor:
    """A seeded [s, b, h] tensor (Megatron's layout), the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + salt)
    return torch.randn(args.seq, args.batch, args.hidden, generator=gen).to(device)


def parallel_blocks(ref: nn.Sequential, sequence_parallel: bool) -> nn.Sequential:
    from labkit.parallel.tensor import ParallelBlock

    return nn.Sequential(*[ParallelBlock.from_block(b, sequence_parallel=sequence_parallel)
                           for b in ref])


def shard_of(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of `full` that `local` is on this rank: the whole tensor when the shapes agree,
    else this rank's contiguous block along the one dimension that differs."""
    if full.shape == local.shape:
        return full
    dims = [d for d, (a, b) in enumerate(zip(full.shape, local.shape)) if a != b]
    if len(dims) != 1 or full.shape[dims[0]] % local.shape[dims[0]]:
        raise ValueError(f"a shard of shape {tuple(local.shape)} does not split "
                         f"{tuple(full.shape)} along one dimension")
    n = local.shape[dims[0]]
    return full.narrow(dims[0], rank * n, n)


def max_diff(a, b) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def grad_diffs(model: nn.Module, ref: nn.Module, rank: int) -> dict:
    """{parameter name: max |grad - the reference grad's matching shard|}."""
    ref_params = dict(ref.named_parameters())
    return {n: max_diff(p.grad, shard_of(ref_params[n].grad, p, rank))
            for n, p in model.named_parameters()}


def run_block(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.labs.tp.dtensor import LayerWindows, tally
    from labkit.labs.common.training import barrier, median
    from labkit.models import get_model
    from labkit.parallel.tensor import sync_sequence_parallel_grads

    sp, n, rank = args.sequence_parallel, ctx.world_size, ctx.rank
    ref = build_blocks(args, ctx.device)
    x, w = block_input(args, ctx.device), block_input(args, ctx.device, salt=2)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    (yr * w).sum().backward()

    model = parallel_blocks(ref, sp)
    local = (lambda t: t.chunk(n, 0)[rank]) if sp else (lambda t: t)
    xi = local(x).clone().requires_grad_(True)
    counter = measure.CollectiveCounter()
    windows = LayerWindows(list(model), counter)
    with counter:
        y = model(xi)
        (y * local(w)).sum().backward()
    windows.close()
    with measure.CollectiveCounter() as synced:
        if sp:
            sync_sequence_parallel_grads(model)
    spec = get_model("debug-gpt2").with_(
        name="lab-block", num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
        num_kv_heads=args.heads, ffn_size=4 * args.hidden, max_seq_len=max(args.seq, 64))
    comm = step_communication("tp", model=spec, tp=n, batch_size=args.batch, seq_len=args.seq,
                              sequence_parallel=sp, activation_bytes=4)
    predicted = {op: {"calls": c, "bytes": b} for op, (c, b) in comm.payload.items()}
    counted = tally(counter.events)
    grads = grad_diffs(model, ref, rank)
    diffs = dict(output_max_diff=max_diff(y, local(yr)),
                 input_grad_max_diff=max_diff(xi.grad, local(xr.grad)))
    times = []
    for _ in range(args.steps):                      # timed steps, after the counted one
        model.zero_grad()
        xt = xi.detach().requires_grad_(True)
        barrier(ctx)
        t = time.perf_counter()
        (model(xt) * local(w)).sum().backward()
        times.append(time.perf_counter() - t)
    return dict(part="block", rank=rank, world_size=n, sequence_parallel=sp, layers=args.layers,
                hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq,
                **diffs, weight_grad_max_diff=max(grads.values()), grad_max_diff=grads,
                per_layer=windows.by_layer(args.layers), collectives=counted,
                predicted_collectives=predicted,
                ratio_calls={k: counted.get(k, [0, 0])[0] / v["calls"]
                             for k, v in predicted.items()},
                ratio_bytes={k: counted.get(k, [0, 0])[1] / v["bytes"]
                             for k, v in predicted.items()},
                extra_kinds=sorted(set(counted) - set(predicted)), step_s=median(times),
                sequence_parallel_sync=tally(synced.events))


class _TdnnColumn(nn.Module):
    """A column-parallel Linear gathered with torch.distributed.nn.functional.all_gather;
    with_f: Megatron's f before the matmul (the input gradient summed over ranks)."""

    def __init__(self, linear: nn.Linear, n: int, rank: int, with_f: bool):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(n, 0)[rank].clone())
        self.bias = nn.Parameter(linear.bias.detach().chunk(n, 0)[rank].clone())
        self.with_f = with_f

    def forward(self, x):
        import torch.distributed.nn.functional as tdnn

        from labkit.parallel.tensor import f

        if self.with_f:
            x = f.apply(x)
        with warnings.catch_warnings():      # 2.13 deprecates it; the pitfall is its backward
            warnings.simplefilter("ignore", FutureWarning)
            parts = tdnn.all_gather(F.linear(x, self.weight, self.bias))
        return torch.cat(parts, dim=-1)


def pitfall_layer(kind: str, linear: nn.Linear, n: int, rank: int) -> nn.Module:
    from labkit.parallel.tensor import ColumnParallelLinear, NoAutogradColumnParallelLinear

    if kind == "dist.all_gather":
        return NoAutogradColumnParallelLinear.from_linear(linear)
    if kind == "gather (Megatron)":
        return ColumnParallelLinear.from_linear(linear, gather_output=True)
    return _TdnnColumn(linear, n, rank, with_f=kind.endswith(", f"))


def run_pitfall(args, ctx) -> dict:
    n, rank = ctx.world_size, ctx.rank
    torch.manual_seed(args.seed)
    linear = nn.Linear(args.hidden, 2 * args.hidden).to(ctx.device)
    x = block_input(args, ctx.device)
    w = torch.randn(args.seq, args.batch, 2 * args.hidden,
                    generator=torch.Generator().manual_seed(args.seed + 7)).to(ctx.device)
    xr = x.clone().requires_grad_(True)
    yr = linear(xr)
    (yr * w).sum().backward()
    rows = {}
    for kind in PITFALLS:
        layer = pitfall_layer(kind, linear, n, rank)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        scale = n if "loss / tp" in kind else 1
        ((y * w).sum() / scale).backward()
        rows[kind] = dict(output=max_diff(y, yr), input_grad=max_diff(xi.grad, xr.grad),
                          weight_grad=max_diff(layer.weight.grad,
                                               shard_of(linear.weight.grad, layer.weight, rank)),
                          weight_grad_ratio=(layer.weight.grad.norm() / shard_of(
                              linear.weight.grad, layer.weight, rank).norm()).item())
    tol = 1e-4
    return dict(part="pitfall", rank=rank, world_size=n, hidden=args.hidden, tolerance=tol,
                rows=rows, wrong=[k for k, r in rows.items()
                                  if max(r["output"], r["input_grad"], r["weight_grad"]) > tol])


def print_block(r: dict) -> None:
    sp = " with sequence parallelism" if r["sequence_parallel"] else ""
    print(f"{r['layers']} hand-built Megatron layer(s), h {r['hidden']}, {r['heads']} heads, "
          f"tp {r['world_size']}{sp}; x [{r['seq']}, {r['batch']}, {r['hidden']}] fp32")
    print(f"  vs one device: output {r['output_max_diff']:.1e}, input grad "
          f"{r['input_grad_max_diff']:.1e}, weight-shard grads {r['weight_grad_max_diff']:.1e}")
    for i, row in enumerate(r["per_layer"]):
        print(f"  layer {i}: " + "; ".join(
            f"{ph} " + ", ".join(f"{k} {c}" for k, (c, _) in row[ph].items()) for ph in row))
    for k, p in r["predicted_collectives"].items():
        c, b = r["collectives"].get(k, [0, 0])
        print(f"  {k:<15}{c:>4}x {b:>10,} B   step_communication('tp') {p['calls']:>4}x "
              f"{p['bytes']:>10,.0f} B   ratio {r['ratio_bytes'][k]:.3f}")
    if r["sequence_parallel_sync"]:
        c, b = r["sequence_parallel_sync"]["all_reduce"]
        print(f"  + LayerNorm gradients summed after backward: all_reduce {c}x {b:,} B")


def print_pitfall(r: dict) -> None:
    print(f"column-parallel Linear ({r['hidden']} -> {2 * r['hidden']}), output gathered, "
          f"tp {r['world_size']}: max |difference| from one device")
    print(f"  {'gathered with':<30}{'output':>9}{'input grad':>12}{'weight grad':>13}"
          f"{'|grad| ratio':>14}")
    for k, row in r["rows"].items():
        flag = "  WRONG" if k in r["wrong"] else ""
        print(f"  {k:<30}{row['output']:>9.1e}{row['input_grad']:>12.1e}"
              f"{row['weight_grad']:>13.1e}{row['weight_grad_ratio']:>14.3f}{flag}")
