"""--part cp of labkit.labs.threed: ring attention (labkit.parallel.context) on 2 or 4 ranks.

    labkit run threed -n 2 -- --part cp         # ring attention (or -n 4)

labkit.labs.threed.lab calls run_cp(args, ctx) and print_cp: `ring_attention` forward and
backward beside full causal attention on one process (SDPA), its K/V messages beside
step_communication("cp"), its saved bytes beside one process's. Source: Liu et al. 2023 (ring
attention). What is reported, and why the backward's ratio is 0.5: docs/labs.md, ## threed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.runtime import measure


def qkv(args, kv_heads: int):
    gen = torch.Generator().manual_seed(args.seed * 7919 + 3)
    d = args.hidden // args.heads
    q = torch.randn(args.batch, args.heads, args.seq, d, generator=gen)
    k, v = (torch.randn(args.batch, kv_heads, args.seq, d, generator=gen) for _ in range(2))
    return q, k, v


def one_process_saved(q, k, v) -> int:
    """Bytes autograd saves for causal attention written out (scores kept), one process."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    reps = q.shape[1] // k.shape[1]
    with measure.SavedActivations() as saved:
        kk, vv = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
        s = q.shape[2]
        scores = (q @ kk.transpose(-2, -1)) / q.shape[-1] ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        (scores.masked_fill(mask, float("-inf")).softmax(-1) @ vv).sum().backward()
    return saved.bytes


def run_cp(args, ctx) -> dict:
    from labkit.comm import step_communication
    from labkit.labs.common import pipeline as ppc
    from labkit.parallel.context import ring_attention, shard_sequence

    cp, rank = ctx.world_size, ctx.rank
    q, k, v = qkv(args, args.kv_heads)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    want.backward(torch.ones_like(want))
    mine = [shard_sequence(t, rank, cp, "zigzag").requires_grad_() for t in (q, k, v)]
    with measure.CollectiveCounter() as fwd, measure.SavedActivations() as saved:
        out = ring_attention(*mine, causal=True, layout="zigzag")
    with measure.CollectiveCounter() as bwd:
        out.backward(torch.ones_like(out))
    diffs = {"output": (out - shard_sequence(want, rank, cp, "zigzag")).abs().max().item()}
    for name, t, ref in zip("qkv", mine, full):
        diffs[f"grad_{name}"] = (t.grad - shard_sequence(ref.grad, rank, cp, "zigzag")
                                 ).abs().max().item()
    spec = ppc.spec_of(args).with_(num_layers=1)
    comm = step_communication("cp", model=spec, cp=cp, batch_size=args.batch, seq_len=args.seq,
                              activation_bytes=4)
    measured = {"forward": {k_: list(v_) for k_, v_ in fwd.by_kind.items()},
                "backward": {k_: list(v_) for k_, v_ in bwd.by_kind.items()}}
    sends = {ph: measured[ph].get("send", [0, 0]) for ph in ("forward", "backward")}
    calls, nbytes = comm.payload.get("send_recv", (0, 0))
    per_phase = {"forward": (cp - 1, calls and nbytes / calls * (cp - 1)),
                 "backward": (calls - (cp - 1), calls and nbytes / calls * (calls - cp + 1))}
    return dict(part="cp", rank=rank, world_size=cp, layout="zigzag", batch=args.batch,
                heads=args.heads, kv_heads=args.kv_heads, seq=args.seq, max_diff=diffs,
                messages=measured, predicted_send_recv=[calls, nbytes],
                predicted_per_phase={ph: list(v) for ph, v in per_phase.items()},
                ratio_sends={ph: (sends[ph][0] / per_phase[ph][0] if per_phase[ph][0] else None,
                                  sends[ph][1] / per_phase[ph][1] if per_phase[ph][1] else None)
                             for ph in sends},
                saved_bytes=saved.bytes, saved_bytes_one_process=one_process_saved(q, k, v))


def print_cp(r: dict) -> None:
    print(f"ring attention, cp {r['world_size']} ({r['layout']}), {r['batch']} x {r['seq']} "
          f"tokens, {r['heads']} heads ({r['kv_heads']} kv)")
    print("  max |diff| vs full attention on one process: "
          + ", ".join(f"{k} {v:.1e}" for k, v in r["max_diff"].items()))
    for ph, (rc, rb) in r["ratio_sends"].items():
        got = r["messages"][ph].get("send", [0, 0])
        print(f"  {ph:<8} sends {got[0]} ({got[1]:,} B); ratio to step_communication('cp'): "
              f"calls {rc if rc is None else f'{rc:.3f}'}, bytes {rb if rb is None else f'{rb:.3f}'}")
    print(f"  saved for backward on this rank {r['saved_bytes']:,} B; one process, scores "
          f"written out: {r['saved_bytes_one_process']:,} B "
          f"(ratio {r['saved_bytes'] / r['saved_bytes_one_process']:.3f})")
