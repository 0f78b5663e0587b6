"""Context parallelism by hand: ring attention over send/recv (Liu et al. 2023; Megatron-LM's CP).

    q, k, v = (shard_sequence(t, rank, cp, layout="zigzag") for t in (q_full, k_full, v_full))
    out = ring_attention(q, k, v, group=cp_group, causal=True, layout="zigzag")
    # == shard_sequence(F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True),
    #                   rank, cp, "zigzag")

How it works: `ring_attention`. torch's own `context_parallel` does not run on CPU in torch 2.13
(its SDPA override has no sharding rule for `aten._scaled_dot_product_flash_attention_for_cpu`;
with the math backend it fails mixing Tensors and DTensors), so the course uses this ring on CPU.
"""
from __future__ import annotations

import math

import torch

from labkit import validate

# Causal masking is per block, by global positions. layout="contiguous": rank r holds chunk r;
# the blocks of later ranks are all masked and skipped, so rank cp-1 computes cp blocks and
# rank 0 one: unbalanced. layout="zigzag" (load-balanced, Megatron-LM / Llama 3): the sequence
# is cut in 2 cp chunks and rank r holds chunks r and 2cp-1-r, one early and one late: every
# rank computes the same number of visible query-key pairs (`causal_work`).
LAYOUTS = ("contiguous", "zigzag")


def _check_split(seq_len: int, cp: int, layout: str) -> int:
    """Tokens per rank; ValueError unless the layout splits seq_len evenly."""
    validate.choice("layout", layout, LAYOUTS)
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    cp = validate.positive_int("cp", cp, validate.MAX_RANKS)
    chunks = 2 * cp if layout == "zigzag" else cp
    if s % chunks:
        raise ValueError(f"seq_len={s} does not split into {chunks} equal chunks (cp={cp}, "
                         f"layout={layout!r}); allowed seq_len: multiples of {chunks}")
    return s // cp


def positions(rank: int, cp: int, seq_len: int, layout: str = "contiguous") -> list[int]:
    """The global positions of the tokens `rank` holds, in the order it holds them."""
    n = _check_split(seq_len, cp, layout)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank={validate.describe(rank)} must be a whole number from 0 to "
                         f"{cp - 1} (cp={cp})")
    if layout == "contiguous":
        return list(range(rank * n, (rank + 1) * n))
    half = n // 2
    late = 2 * cp - 1 - rank
    return list(range(rank * half, (rank + 1) * half)) + list(range(late * half,
                                                                     (late + 1) * half))


def shard_sequence(x, rank: int, cp: int, layout: str = "contiguous", dim: int = 2):
    """The part of the full-sequence tensor `x` that `rank` holds (sequence along `dim`)."""
    index = torch.tensor(positions(rank, cp, x.shape[dim], layout), device=x.device)
    return x.index_select(dim, index)


def causal_work(cp: int, seq_len: int, layout: str = "contiguous") -> list[int]:
    """Visible (query, key) pairs each rank computes under causal masking (skipped blocks not
    counted; a partly visible block counts its visible pairs): the load balance of `layout`."""
    held = [positions(r, cp, seq_len, layout) for r in range(cp)]
    return [sum(sum(1 for kp in keys for qp in held[r] if kp <= qp) for keys in held)
            for r in range(cp)]


class RingShift(torch.autograd.Function):
    """Send x to the next rank of the ring, return the previous rank's x. Backward: the
    gradient goes the other way (to the previous rank; the next rank's comes back)."""

    @staticmethod
    def forward(ctx, x, group, to, frm):
        ctx.group, ctx.to, ctx.frm = group, to, frm
        return _exchange(x.contiguous(), group, to, frm)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, ctx.frm, ctx.to), None, None, None


def _exchange(x, group, to, frm):
    import torch.distributed as dist

    out = torch.empty_like(x)
    reqs = [dist.isend(x, group=group, group_dst=to), dist.irecv(out, group=group, group_src=frm)]
    for r in reqs:
        r.wait()
    return out


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seq, head_dim]; got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    b, h, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d) or h % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, the "
                         f"local sequence and head_dim, and k's heads must divide q's {h}")


def _attend(q, q_pos, blocks, causal: bool, scale: float):
    """Combine q's attention over `blocks` (k, v, k_pos) with the log-sum-exp trick; blocks
    whose keys are all in the future of every query are skipped."""
    out = lse = None
    for k, v, k_pos in blocks:
        reps = q.shape[1] // k.shape[1]
        if reps > 1:                                     # GQA: each KV head serves reps heads
            k, v = k.repeat_interleave(reps, dim=1), v.repeat_interleave(reps, dim=1)
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            masked = k_pos[None, :] > q_pos[:, None]
            if bool(masked.all()):
                continue
            scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        lse_b = torch.logsumexp(scores, dim=-1, keepdim=True)
        out_b = torch.exp(scores - lse_b) @ v
        if out is None:
            out, lse = out_b, lse_b
        else:
            new = torch.logaddexp(lse, lse_b)
            out = torch.exp(lse - new) * out + torch.exp(lse_b - new) * out_b
            lse = new
    return out


def ring_attention(q, k, v, *, group=None, causal: bool = True, layout: str = "contiguous",
                   scale: float | None = None):
    """This rank's attention output for its queries against the whole sequence's keys, passing
    K/V blocks around `group` (default: the world; without a process group, one rank).
    q, k, v: this rank's part of the sequence, as `shard_sequence(..., layout)` cuts it.

    Each of the cp ranks of a group holds s/cp of the sequence: its queries, keys and values.
    Full attention needs every query against every key, so the ranks pass their K/V block
    around the ring (rank r sends to r+1 and receives from r-1), cp - 1 times, and each rank
    combines the partial results it computes against every block with the log-sum-exp trick:
    for two partial results (out_a, lse_a) and (out_b, lse_b) over disjoint sets of keys,

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    which is exactly softmax over the union (out_a is softmax-weighted over its keys, lse_a the
    log of its softmax denominator). No rank ever holds an s x s score matrix, only
    (s/cp) x (s/cp).

    Shapes: [batch, heads, s/cp, head_dim] (SDPA's layout); k, v may have fewer (KV) heads
    (GQA): the smaller K/V blocks are what travels. K and V travel packed in one message per
    step, of 2 x b x (s/cp) x kv_size x bytes: what `labkit.comm.step_communication("cp", ...)`
    counts. Causal masking: the layouts, above `LAYOUTS`.

    Backward: autograd through the local ops; each ring step is `RingShift`, whose backward
    sends the K/V block's gradient back the way the block came (cp - 1 messages of the same
    size; every rank runs all of them, also for blocks it masked: see the end of this
    function). Autograd keeps every received block for the backward (cp blocks of K/V per
    rank) instead of passing K/V around a second time: 2 (cp - 1) messages per layer where
    step_communication's Megatron-style count, which re-sends K/V in the backward to keep one
    block at a time, is 3 (cp - 1). Messages are not overlapped with compute here (a real
    implementation posts the next send/recv before it computes on the current block)."""
    import torch.distributed as dist

    _check_qkv(q, k, v)
    validate.choice("causal", causal, (False, True))
    if dist.is_available() and dist.is_initialized():
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        cp, rank = 1, 0
    s = q.shape[2] * cp
    _check_split(s, cp, layout)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else validate.positive("scale", scale)
    pos = {r: torch.tensor(positions(r, cp, s, layout), device=q.device) for r in range(cp)}
    d = k.shape[-1]

    chain = [torch.cat([k, v], dim=-1)]                 # one message per step: K and V packed

    def blocks():
        for step in range(cp):
            if step:
                chain.append(RingShift.apply(chain[-1], group, (rank + 1) % cp, (rank - 1) % cp))
            kb, vb = chain[-1].split(d, dim=-1)
            yield kb, vb, pos[(rank - step) % cp]

    out = _attend(q, pos[rank], blocks(), causal, scale)
    # Every rank must run every RingShift's backward, in the same order, or the ring deadlocks:
    # a rank whose last blocks were all masked (causal, contiguous: rank 0 uses none it
    # received) would otherwise skip them, and the gradients others send it would never be
    # received. A zero-weighted use of the last block keeps the whole chain in the graph.
    return out + 0.0 * chain[-1].sum() if cp > 1 else out


def simulated_ring_attention(q, k, v, cp: int, *, causal: bool = True,
                             layout: str = "contiguous", scale: float | None = None):
    """The same computation for all cp ranks in this process (no messages): full-sequence q, k,
    v in, the full output out (each rank's part put back at its positions). For the notebook
    and for checks on one process, backward included."""
    _check_qkv(q, k, v)
    validate.choice("causal", causal, (False, True))
    s = q.shape[2]
    _check_split(s, cp, layout)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else validate.positive("scale", scale)
    held = [torch.tensor(positions(r, cp, s, layout), device=q.device) for r in range(cp)]
    kv = [(k.index_select(2, p), v.index_select(2, p), p) for p in held]
    parts = [_attend(q.index_select(2, held[r]), held[r],
                     (kv[(r - step) % cp] for step in range(cp)), causal, scale)
             for r in range(cp)]
    order = torch.argsort(torch.cat(held))
    return torch.cat(parts, dim=2).index_select(2, order)
