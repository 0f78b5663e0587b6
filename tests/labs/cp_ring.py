"""Fixture lab for tests/test_context.py: labkit.parallel.context.ring_attention on real ranks.

    torchrun --nproc-per-node 4 tests/labs/cp_ring.py

Every rank builds the same full-sequence q, k, v (float64, GQA: fewer KV heads) and the full
attention on one process (SDPA), then runs the ring on its part of the sequence:
- over the whole world (cp = world size), each layout, causal and not;
- over the cp groups of a dp x cp = (world/2) x 2 DeviceMesh (Degrees.build_mesh): a ring of 2
  ranks inside a larger world (group ranks are not global ranks).
Reports per case `diff`: max |ring - the same positions of the reference| for the output and
for the q, k, v gradients (loss = sum(out * w), the same w cut the same way), and `comm`:
{"forward"|"backward": CollectiveCounter.by_kind} of this rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.parallel.context import LAYOUTS, ring_attention, shard_sequence
from labkit.parallel.mesh import Degrees
from labkit.runtime import dist
from labkit.runtime.measure import CollectiveCounter

B, HEADS, KV_HEADS, S, D = 2, 4, 2, 16, 8


def full(seed, heads):
    return torch.randn(B, heads, S, D, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def case(rank, cp, group, layout, causal):
    q, k, v, w = full(1, HEADS), full(2, KV_HEADS), full(3, KV_HEADS), full(4, HEADS)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=True)
    (ref * w).sum().backward()
    cut = lambda t: shard_sequence(t.detach(), rank, cp, layout)      # noqa: E731
    mine = [cut(t).requires_grad_() for t in (q, k, v)]
    with CollectiveCounter() as fwd:
        out = ring_attention(*mine, group=group, causal=causal, layout=layout)
    with CollectiveCounter() as bwd:
        (out * cut(w)).sum().backward()
    diff = {"out": (out - cut(ref)).abs().max().item()}
    for name, a, b in zip("qkv", mine, ref_in):
        diff[f"{name}_grad"] = (a.grad - cut(b.grad)).abs().max().item()
    return {"diff": diff, "comm": {"forward": fwd.by_kind, "backward": bwd.by_kind}}


def main():
    ctx = dist.setup("gloo")
    out = {"world_size": ctx.world_size}
    for layout in LAYOUTS:
        for causal in (True, False):
            out[f"world_{layout}_{'causal' if causal else 'full'}"] = case(
                ctx.rank, ctx.world_size, None, layout, causal)
    deg = Degrees.for_world(ctx.world_size, cp=2)
    cp_mesh = deg.build_mesh("cpu")["cp"]
    out["cp2_group"] = case(cp_mesh.get_local_rank(), 2, cp_mesh.get_group(), "zigzag", True)
    dist.report(**out)
    dist.shutdown()


if __name__ == "__main__":
    main()
