"""What each collective does, on real ranks: one launch runs broadcast, reduce, all_reduce,
all_gather, reduce_scatter, all_to_all and send/recv on small tensors and reports what every rank
held before and after each.

    python -m labkit.labs.semantics                                   # 1 process (trivial)
    torchrun --nproc-per-node 4 -m labkit.labs.semantics              # 4 ranks (gloo on CPU)
    labkit run semantics -n 4                                         # the same through labkit
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 -m labkit.labs.semantics           # two nodes

Inputs ("23" reads "from rank 2, chunk 3"), roots, the report: docs/labs.md, ## semantics.
"""
from __future__ import annotations

import argparse

OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "send_recv")


def _gather_into(out, inp):
    import torch.distributed as tdist
    # torch 2.13 names it all_gather_single; older versions all_gather_into_tensor
    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    fn(out, inp)


def _reduce_scatter_into(out, inp):
    import torch.distributed as tdist
    fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    fn(out, inp)


def run_op(op: str, rank: int, world_size: int, device) -> tuple[list, list]:
    """Run `op` once on this rank; return (before, after) as lists of numbers."""
    import torch
    import torch.distributed as tdist

    n = world_size
    x = torch.tensor([10.0 * rank + c for c in range(n)], device=device)
    before = x.tolist()
    if op == "broadcast":
        if rank != 0:                      # non-roots hold anything: we show zeros
            x.zero_()
            before = x.tolist()
        tdist.broadcast(x, src=0)
        after = x.tolist()
    elif op == "reduce":
        tdist.reduce(x, dst=0)             # only rank 0's buffer is defined afterwards
        after = x.tolist()
    elif op == "all_reduce":
        tdist.all_reduce(x)
        after = x.tolist()
    elif op == "all_gather":
        x = x[:1].clone()                  # one number per rank: 10 * rank
        before = x.tolist()
        out = torch.empty(n, device=device)
        _gather_into(out, x)
        after = out.tolist()
    elif op == "reduce_scatter":
        out = torch.empty(1, device=device)
        _reduce_scatter_into(out, x)       # chunk r of the sum lands on rank r
        after = out.tolist()
    elif op == "all_to_all":
        out = torch.empty(n, device=device)
        tdist.all_to_all_single(out, x)    # chunk c of rank r goes to rank c, slot r
        after = out.tolist()
    elif op == "send_recv":
        if rank == 0:
            tdist.send(x, dst=1)
        elif rank == 1:
            x.zero_()
            before = x.tolist()
            tdist.recv(x, src=0)
        after = x.tolist()
    else:
        raise ValueError(f"op={op!r} is not supported; allowed: {', '.join(OPS)}")
    return before, after


def format_table(results: dict, ops=OPS) -> str:
    """results: {rank: {op: {"before": [...], "after": [...]}}} -> a text table per op."""
    lines = []
    for op in ops:
        lines.append(f"{op}")
        for r in sorted(results):
            if op in results[r]:
                b, a = results[r][op]["before"], results[r][op]["after"]
                fmt = lambda v: "[" + ", ".join(f"{x:g}" for x in v) + "]"  # noqa: E731
                lines.append(f"  rank {r}: before {fmt(b):<24} after {fmt(a)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated subset of {', '.join(OPS)} (default: all)")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            parser.error(f"--ops: {o!r} is not supported; allowed: {', '.join(OPS)}")

    from labkit.runtime import dist
    import torch.distributed as tdist

    ctx = dist.setup()
    if "send_recv" in ops and ctx.world_size < 2:
        ops.remove("send_recv")            # needs a second rank
    mine = {}
    for op in ops:
        tdist.barrier()
        before, after = run_op(op, ctx.rank, ctx.world_size, ctx.device)
        mine[op] = {"before": before, "after": after}
    dist.report(**mine, world_size=ctx.world_size, backend=ctx.backend)

    everyone = [None] * ctx.world_size
    tdist.all_gather_object(everyone, mine)
    dist.print0(f"{ctx.world_size} ranks, backend {ctx.backend}")
    dist.print0(format_table(dict(enumerate(everyone)), ops))
    dist.shutdown()


if __name__ == "__main__":
    main()
