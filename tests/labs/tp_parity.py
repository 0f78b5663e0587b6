"""Fixture lab for tests/test_tensor.py: labkit.parallel.tensor against one device, on real ranks.

    torchrun --nproc-per-node 4 tests/labs/tp_parity.py

Every rank builds each single-device reference (the same seed on every rank, float64) and its
tensor-parallel version from the same weights, runs both on the same input and reports, per case,
`diff`: {what: max |parallel - the matching part of the reference|} for the output, the input
gradient and each parameter's gradient (a shard's gradient against the same slice of the full
one); where counted, `comm`: {"forward"/"backward"/"sync": CollectiveCounter.by_kind};
`errors`: {case: "ValueError: message"} for the bad inputs in BAD. `functions`: f, g and
sp_split on their own, against gradients known in closed form. The pitfall's case also
reports `summed_input_grad`: its input gradients all-reduced over the ranks, against the true one.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from labkit.parallel import tensor as tp
from labkit.runtime import dist
from labkit.runtime.measure import CollectiveCounter

S, B, H, HEADS, V = 8, 2, 16, 4, 32     # sequence, batch, hidden, heads, vocabulary
DTYPE = torch.float64                   # parity to rounding of float64 (~1e-15)


def rows(t, ctx):        # this rank's contiguous 1/tp of dim 0 (column shards, sequence shards)
    return t.chunk(ctx.world_size, dim=0)[ctx.rank]


def cols(t, ctx):        # ... of the last dim (row-parallel weights, feature slices)
    return t.chunk(ctx.world_size, dim=-1)[ctx.rank]


def data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def maxdiff(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def run(ref, par, x, x_par, weight, split, comm=None, sync=False):
    """Forward and backward both; loss = sum(out * weight) (the same weight on every rank).
    split(name, ref_tensor) -> the part of the reference a rank's tensor must equal."""
    ref.zero_grad(set_to_none=True)                  # a reference may serve two cases
    x = x.clone().requires_grad_()
    x_par = x_par.clone().requires_grad_()
    out = ref(x)
    (out * weight).sum().backward()
    counters = {k: CollectiveCounter() for k in ("forward", "backward", "sync")}
    with counters["forward"]:
        out_par = par(x_par)
    with counters["backward"]:
        (out_par * split("out", weight)).sum().backward()
    with counters["sync"]:
        if sync:
            tp.sync_sequence_parallel_grads(par)
    diff = {"out": maxdiff(out_par, split("out", out)),
            "input_grad": maxdiff(x_par.grad, split("input", x.grad))}
    grads = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        diff[name] = maxdiff(p.grad, split(name, grads[name].grad))
    result = {"diff": diff, "shapes": {n: list(p.shape) for n, p in par.named_parameters()}}
    if comm:
        result["comm"] = {k: c.by_kind for k, c in counters.items()}
    return result, x_par.grad


def shard_of(ctx, sequence_parallel=False):
    """A block's names -> how its reference tensors are split on this rank."""
    def split(name, t):
        if name in ("out", "input"):
            return rows(t, ctx) if sequence_parallel else t
        if name.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias")):
            return rows(t, ctx)                                   # column: output features
        if name.endswith(("proj.weight", "fc2.weight")):
            return cols(t, ctx)                                   # row: input features
        return t                                                  # LayerNorms, row biases
    return split


def linear_cases(ctx):
    torch.manual_seed(1)
    ref = nn.Linear(H, 2 * H).to(DTYPE)
    x, w = data(2, S, B, H), data(3, S, B, 2 * H)
    out = {}
    # column, output left split: this rank's loss term is its slice's
    col = tp.ColumnParallelLinear.from_linear(ref)
    out["column"] = run(ref, col, x, x, w, lambda n, t: t if n == "input" else cols(t, ctx)
                        if n == "out" else rows(t, ctx))[0]
    col = tp.ColumnParallelLinear.from_linear(ref, gather_output=True)
    out["column_gathered"] = run(ref, col, x, x, w, lambda n, t: t if n in ("out", "input")
                                 else rows(t, ctx))[0]
    torch.manual_seed(4)
    ref = nn.Linear(2 * H, H).to(DTYPE)
    x, w = data(5, S, B, 2 * H), data(6, S, B, H)
    row = tp.RowParallelLinear.from_linear(ref)
    out["row"] = run(ref, row, x, cols(x, ctx), w, lambda n, t: cols(t, ctx)
                     if n in ("input", "weight") else t)[0]
    row = tp.RowParallelLinear.from_linear(ref, input_is_parallel=False)
    out["row_full_input"] = run(ref, row, x, x, w, lambda n, t: cols(t, ctx)
                                if n == "weight" else t)[0]
    # the pitfall: output and weight gradient right, input gradient a partial sum
    torch.manual_seed(1)
    ref = nn.Linear(H, 2 * H).to(DTYPE)
    x, w = data(2, S, B, H), data(3, S, B, 2 * H)
    bad = tp.NoAutogradColumnParallelLinear.from_linear(ref)
    result, x_grad = run(ref, bad, x, x, w, lambda n, t: t if n in ("out", "input")
                         else rows(t, ctx))
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * w).sum().backward()
    summed = x_grad.clone()
    tdist.all_reduce(summed)
    result["summed_input_grad"] = maxdiff(summed, x_ref.grad)
    out["no_autograd_column"] = result
    return out


def function_cases(ctx):
    """f, g and sp_split on their own: each rank's loss term is sum(out * w_rank), w_rank its own,
    so the global loss is sum over ranks and every gradient is known in closed form."""
    n = ctx.world_size
    ws = [data(20 + r, S, B, H) for r in range(n)]                # every rank's weight, known
    x = data(30, S, B, H).requires_grad_()
    (tp.f.apply(x) * ws[ctx.rank]).sum().backward()               # d/dx sum_r (x * w_r)
    diff = {"f_input_grad": maxdiff(x.grad, sum(ws))}
    mine = (data(40 + ctx.rank, S, B, H)).requires_grad_()        # a different x on every rank
    out = tp.g.apply(mine)
    (out * ws[0]).sum().backward()                                # the same loss on every rank
    diff["g_out"] = maxdiff(out, sum(data(40 + r, S, B, H) for r in range(n)))
    diff["g_input_grad"] = maxdiff(mine.grad, ws[0])             # identity backward
    x = data(31, S, B, H).requires_grad_()
    shard = tp.sp_split.apply(x)
    (shard * rows(ws[ctx.rank], ctx)).sum().backward()
    diff["sp_split_out"] = maxdiff(shard, rows(x, ctx))
    expected = torch.cat([w.chunk(n, dim=0)[r] for r, w in enumerate(ws)])   # rank r's part
    diff["sp_split_input_grad"] = maxdiff(x.grad, expected)                   # of its own w_r
    return {"functions": {"diff": diff}}


def block_cases(ctx):
    out = {}
    x, w = data(7, S, B, H), data(8, S, B, H)
    for name, make, convert in (
            ("mlp", lambda: tp.MLP(H), tp.ParallelMLP.from_mlp),
            ("attention", lambda: tp.SelfAttention(H, HEADS), tp.ParallelAttention.from_attention),
            ("block", lambda: tp.Block(H, HEADS), tp.ParallelBlock.from_block)):
        for sp in (False, True):
            torch.manual_seed(9)
            ref = make().to(DTYPE)
            par = convert(ref, sequence_parallel=sp)
            key = name + ("_sp" if sp else "")
            out[key] = run(ref, par, x, rows(x, ctx) if sp else x, w, shard_of(ctx, sp),
                           comm=True, sync=sp)[0]
    return out


class Tiny(nn.Module):
    """embedding -> block -> LayerNorm -> head: the reference for the vocab-parallel pieces."""

    def __init__(self):
        super().__init__()
        self.emb, self.block = nn.Embedding(V, H), tp.Block(H, HEADS)
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)


def model_cases(ctx):
    out = {}
    ids = torch.randint(V, (S, B), generator=torch.Generator().manual_seed(10))
    target = torch.randint(V, (S, B), generator=torch.Generator().manual_seed(11))
    for sp in (False, True):
        torch.manual_seed(12)
        ref = Tiny().to(DTYPE)
        emb = tp.VocabParallelEmbedding.from_embedding(ref.emb, sequence_parallel=sp)
        block = tp.ParallelBlock.from_block(ref.block, sequence_parallel=sp)
        norm = nn.LayerNorm(H).to(DTYPE)
        norm.load_state_dict(ref.norm.state_dict())
        for p in norm.parameters():
            p.sequence_parallel = sp
        head = tp.ColumnParallelLinear.from_linear(ref.head, sequence_parallel=sp)
        logits = ref.head(ref.norm(ref.block(ref.emb(ids))))
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        par = nn.ModuleDict({"emb": emb, "block": block, "norm": norm, "head": head})
        losses = tp.vocab_parallel_cross_entropy(head(norm(block(emb(ids)))), target)
        losses.mean().backward()             # the mean over all s*b tokens: same on every rank
        tp.sync_sequence_parallel_grads(par)
        split = shard_of(ctx)
        grads = dict(ref.named_parameters())
        diff = {"loss": abs(losses.mean().item() - loss.item())}
        for name, p in par.named_parameters():
            full = grads[name].grad
            diff[name] = maxdiff(p.grad, rows(full, ctx) if name in ("emb.weight", "head.weight")
                                 else split(name, full))
        out["model_sp" if sp else "model"] = {"diff": diff}
    # the embedding alone: its rows (sequence-sharded with sp) and its table's gradient
    for sp in (False, True):
        torch.manual_seed(15)
        ref = nn.Embedding(V, H).to(DTYPE)
        emb = tp.VocabParallelEmbedding.from_embedding(ref, sequence_parallel=sp)
        w = data(16, S, B, H)
        (ref(ids) * w).sum().backward()
        with CollectiveCounter() as fwd:
            rows_par = emb(ids)
        (rows_par * (rows(w, ctx) if sp else w)).sum().backward()
        full = ref(ids)
        out["embedding_sp" if sp else "embedding"] = {
            "diff": {"out": maxdiff(rows_par, rows(full, ctx) if sp else full),
                     "weight": maxdiff(emb.weight.grad, rows(ref.weight.grad, ctx))},
            "comm": {"forward": fwd.by_kind}}
    # the loss alone: per-token values and the logits' gradient, slice by slice
    logits = data(13, S, B, V).requires_grad_()
    ref_losses = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    (ref_losses * data(14, S * B)).sum().backward()
    shard = cols(logits.detach(), ctx).requires_grad_()
    with CollectiveCounter() as fwd:
        losses = tp.vocab_parallel_cross_entropy(shard, target)
    with CollectiveCounter() as bwd:
        (losses * data(14, S * B).view(S, B)).sum().backward()
    out["cross_entropy"] = {"diff": {"out": maxdiff(losses.flatten(), ref_losses),
                                     "input_grad": maxdiff(shard.grad, cols(logits.grad, ctx))},
                            "comm": {"forward": fwd.by_kind, "backward": bwd.by_kind}}
    return out


BAD = {
    "column_out": lambda: tp.ColumnParallelLinear.from_linear(nn.Linear(H, 5)),
    "row_in": lambda: tp.RowParallelLinear.from_linear(nn.Linear(5, H)),
    "heads": lambda: tp.ParallelAttention.from_attention(tp.SelfAttention(12, 3)),
    "vocab": lambda: tp.VocabParallelEmbedding.from_embedding(nn.Embedding(5, H)),
    "sequence": lambda: tp.VocabParallelEmbedding.from_embedding(
        nn.Embedding(V, H), sequence_parallel=True)(torch.zeros(5, B, dtype=torch.long)),
    "not_linear": lambda: tp.ColumnParallelLinear.from_linear(nn.Conv1d(2, 2, 1)),
    "flag": lambda: tp.RowParallelLinear.from_linear(nn.Linear(H, H), input_is_parallel="yes"),
    "gather_sp": lambda: tp.ColumnParallelLinear.from_linear(nn.Linear(H, H), gather_output=True,
                                                             sequence_parallel=True),
    "row_sp_full": lambda: tp.RowParallelLinear.from_linear(nn.Linear(H, H), sequence_parallel=True,
                                                            input_is_parallel=False),
    "target": lambda: tp.vocab_parallel_cross_entropy(torch.zeros(S, V // dist.world_size()),
                                                      torch.full((S,), V)),
}


def errors():
    out = {}
    for case, call in BAD.items():
        try:
            call()
            out[case] = None
        except Exception as exc:                       # noqa: BLE001 - reported, asserted
            out[case] = f"{type(exc).__name__}: {exc}"
    return out


def main():
    ctx = dist.setup("gloo")
    dist.report(world_size=ctx.world_size, **function_cases(ctx), **linear_cases(ctx),
                **block_cases(ctx),
                **model_cases(ctx), errors=errors())
    dist.shutdown()


if __name__ == "__main__":
    main()
