"""Mixture of experts on ranks: a transformers Mixtral (random weights, the debug-moe config)
whose MoE blocks run expert-parallel by hand (labkit.parallel.expert), against one process.

    labkit run moe -n 4                                   # every part, EP = 4 and EP 2 x DP 2
    labkit run moe -n 4 -- --part balance --steps 300     # one part

Parts, measured beside predicted: parity (loss and gradients vs one process, all-to-all bytes
vs labkit.comm), balance (tokens per expert while training, without / with the auxiliary
loss), capacity (dropped assignments vs the router's counts), time (all-to-all vs the rest of
the MoE blocks, CPU). Each part's function says what it does.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.parallel import expert as ex
from labkit.runtime import dist
from labkit.runtime.measure import CollectiveCounter

PARTS = ("parity", "balance", "capacity", "time")
MODEL = "debug-moe"


def build_model(seed: int = 0, **overrides):
    """transformers' MixtralForCausalLM from labkit's debug-moe spec, random weights (float32),
    no router jitter; `overrides` go to the config."""
    import transformers

    from labkit.models import get_model

    cfg = get_model(MODEL).to_hf_config(router_jitter_noise=0.0, attn_implementation="eager",
                                        **overrides)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).float()


def moe_from_block(block, capacity_factor=None) -> ex.MoE:
    """labkit's one-process MoE with a Mixtral block's weights: the router's (E, h) gate, and
    each expert's gate_up_proj (gate rows first) and down_proj, transposed to (h, f) / (f, h)."""
    E, two_f, h = block.experts.gate_up_proj.shape
    f = two_f // 2
    moe = ex.MoE(h, f, E, block.top_k, capacity_factor=capacity_factor)
    with torch.no_grad():
        moe.router.gate.weight.copy_(block.gate.weight)
        moe.w_gate.copy_(block.experts.gate_up_proj[:, :f, :].transpose(1, 2))
        moe.w_up.copy_(block.experts.gate_up_proj[:, f:, :].transpose(1, 2))
        moe.w_down.copy_(block.experts.down_proj.transpose(1, 2))
    return moe


class Block(nn.Module):
    """A Mixtral MoE block replaced by labkit's: `ExpertParallelMoE` over `group`, or the
    one-process `MoE` (group=False). (batch, seq, h) in and out, as the decoder layer calls it;
    `aux` collects each forward's auxiliary loss, `stats` its MoEStats."""

    def __init__(self, moe: ex.MoE, group=None):
        super().__init__()
        self.inner = moe if group is False else ex.ExpertParallelMoE.from_moe(moe, group)
        self.aux: list = []

    def forward(self, x):
        y = self.inner(x)
        self.aux.append(self.inner.last.aux_loss)
        return y


def replace_blocks(model, group=None, capacity_factor=None) -> list[Block]:
    """Swap every layer's Mixtral MoE block for a `Block` (in place); returns them."""
    blocks = []
    for layer in model.model.layers:
        layer.mlp = Block(moe_from_block(layer.mlp, capacity_factor), group)
        blocks.append(layer.mlp)
    return blocks


def batch(seed: int, sequences: int, seq_len: int, vocab: int, common: int = 0):
    """Token ids (sequences, seq_len): uniform, or (common > 0) a synthetic language whose
    first `common` ids make up half of the tokens (so routing has something to learn)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sequences, seq_len), generator=g)
    if common:
        frequent = torch.randint(0, common, (sequences, seq_len), generator=g)
        ids = torch.where(torch.rand(sequences, seq_len, generator=g) < 0.5, frequent, ids)
    return ids


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def all_reduce_dense(model, group=None) -> None:
    """Sum the gradients of everything but the routed experts over `group`, in one message
    (the data-parallel gradient all-reduce that DDP would bucket)."""
    grads = [p.grad for n, p in model.named_parameters() if not _is_expert(n)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    tdist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _is_expert(name: str) -> bool:
    return name.split(".")[-1] in ("w_gate", "w_up", "w_down")


def parity(ctx, ep_size: int, sequences: int, seq_len: int) -> dict:
    """One step of the model with EP over groups of `ep_size` ranks against one process."""
    from labkit.comm import step_communication
    from labkit.parallel.mesh import Degrees

    world, rank = ctx.world_size, ctx.rank
    deg = Degrees.for_world(world, ep=ep_size)
    ep_group = edp_group = None
    for ranks in deg.groups("ep"):
        g = tdist.new_group(ranks)
        if rank in ranks:
            ep_group, ep_rank = g, ranks.index(rank)
    for ranks in deg.groups("edp"):
        g = tdist.new_group(ranks)
        if rank in ranks:
            edp_group = g
    ref = build_model()
    ids = batch(1, world * sequences, seq_len, ref.config.vocab_size)
    with torch.no_grad():
        loss_hf = lm_loss(ref, ids).item()            # transformers' own Mixtral blocks
    replace_blocks(ref, group=False)                  # labkit's one-process MoE, same weights
    loss_ref = lm_loss(ref, ids)
    loss_ref.backward()

    model = build_model()
    blocks = replace_blocks(model, group=ep_group)
    mine = ids[rank * sequences:(rank + 1) * sequences]
    with CollectiveCounter() as comm:
        loss = lm_loss(model, mine)
        (loss / world).backward()                    # equal tokens per rank: the global mean
    all_reduce_dense(model)                          # dense: data-parallel over every rank
    if deg.edp > 1:                                   # experts: summed over their replicas
        for name, p in model.named_parameters():
            if _is_expert(name):
                tdist.all_reduce(p.grad, group=edp_group)
    global_loss = loss.detach().clone()
    tdist.all_reduce(global_loss)
    global_loss /= world
    ref_params = dict(ref.named_parameters())
    worst = {"dense": 0.0, "experts": 0.0}
    local = blocks[0].inner.local
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if _is_expert(name):
            want = want[ep_rank * local:(ep_rank + 1) * local]
        kind = "experts" if _is_expert(name) else "dense"
        worst[kind] = max(worst[kind], (p.grad - want).abs().max().item())
    a2a_count, a2a_bytes = comm.by_kind.get("all_to_all", (0, 0))
    # a rank sends its own tokens' assignments (dispatch) but returns whatever its experts
    # received (combine): per rank it varies with the routing, summed over the ranks it does not
    total = torch.tensor([float(a2a_bytes)], dtype=torch.float64)
    tdist.all_reduce(total)
    spec_model = _spec()
    predicted = step_communication("ep", spec_model, ep=ep_size, seq_len=seq_len,
                                   batch_size=sequences, activation_bytes=4).collectives
    data = sum(c.count * c.nbytes for c in predicted)
    counts_bytes = len(blocks) * spec_model.num_experts * 8      # one int64 count per expert
    return {"ep": ep_size, "edp": deg.edp, "loss": global_loss.item(),
            "loss_reference": loss_ref.item(), "loss_transformers": loss_hf,
            "max_grad_diff": worst,
            "all_to_all_calls": a2a_count, "all_to_all_bytes": a2a_bytes,
            "all_to_all_bytes_all_ranks": total.item(),
            "predicted_bytes": data + counts_bytes,
            "predicted_calls": sum(c.count for c in predicted) + len(blocks),
            "bytes_ratio": total.item() / (world * (data + counts_bytes))}


def _spec():
    from labkit.models import get_model

    return get_model(MODEL)


def imbalance(counts: torch.Tensor) -> float:
    """max / mean tokens per expert (1 when perfectly balanced)."""
    c = counts.double()
    return (c.max() / c.mean()).item()


def whole_batch_counts(block) -> torch.Tensor:
    """Tokens per expert of the last forward over every rank's tokens (an all_reduce)."""
    counts = block.inner.last.tokens_per_expert.clone().long()
    tdist.all_reduce(counts)
    return counts


def balance(ctx, steps: int, sequences: int, seq_len: int, aux_coef: float) -> dict:
    """Train with EP over every rank for `steps` steps; tokens per expert (whole batch) of
    each layer at each step, with `aux_coef` x the auxiliary loss added."""
    model = build_model()
    blocks = replace_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    per_step = []
    for step in range(steps):
        ids = batch(100 + step * ctx.world_size + ctx.rank, sequences, seq_len,
                    model.config.vocab_size, common=16)
        for b in blocks:
            b.aux.clear()
        loss = lm_loss(model, ids) + aux_coef * sum(sum(b.aux) for b in blocks)
        opt.zero_grad()
        (loss / ctx.world_size).backward()
        all_reduce_dense(model)
        opt.step()
        per_step.append([imbalance(whole_batch_counts(b)) for b in blocks])
        if ctx.rank == 0 and (step + 1) % 50 == 0:
            print(f"balance, aux {aux_coef:g}: step {step + 1} of {steps}, max/mean "
                  + ", ".join(f"{x:.2f}" for x in per_step[-1]), flush=True)
    tail = per_step[-max(1, steps // 10):]
    return {"aux_coef": aux_coef, "steps": steps,
            "imbalance_first": per_step[0], "imbalance_last": [
                statistics.fmean(s[i] for s in tail) for i in range(len(blocks))],
            "tokens_per_expert_last": [whole_batch_counts(b).tolist() for b in blocks]}


def capacity_part(ctx, sequences: int, seq_len: int, factors) -> list[dict]:
    """One forward per capacity factor with EP over every rank, the same trained-free model
    and batch: dropped assignments measured, and predicted from the router's counts."""
    out = []
    ids = batch(7 + ctx.rank, sequences, seq_len, 1024, common=16)
    for cf in factors:
        model = build_model()
        blocks = replace_blocks(model, capacity_factor=cf)
        with torch.no_grad():
            lm_loss(model, ids)
        for i, b in enumerate(blocks):
            last = b.inner.last
            counts = whole_batch_counts(b)
            dropped = torch.zeros((), dtype=torch.long) + last.dropped
            tdist.all_reduce(dropped)
            predicted = int((counts - last.capacity).clamp(min=0).sum())
            assignments = int(counts.sum())
            out.append({"capacity_factor": cf, "layer": i, "capacity": last.capacity,
                        "dropped": int(dropped), "predicted": predicted,
                        "assignments": assignments,
                        "balanced_share": max(0.0, 1 - cf), "share": int(dropped) / assignments,
                        "imbalance": imbalance(counts)})
    return out


def timing(ctx, steps: int, sequences: int, seq_len: int) -> dict:
    """Seconds per training step, its MoE blocks and their all-to-alls (EP over every rank)."""
    model = build_model()
    blocks = replace_blocks(model)
    spent = {"a2a": 0.0, "moe": 0.0}
    original = tdist.all_to_all_single

    def timed_a2a(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent["a2a"] += time.perf_counter() - t0

    starts = {}

    def pre(module, *_):
        starts[id(module)] = time.perf_counter()

    def post(module, *_):
        spent["moe"] += time.perf_counter() - starts.pop(id(module))

    hooks = []
    for b in blocks:
        hooks += [b.register_forward_pre_hook(pre), b.register_forward_hook(post),
                  b.register_full_backward_pre_hook(pre), b.register_full_backward_hook(post)]
    rows = []
    tdist.all_to_all_single = timed_a2a
    try:
        for step in range(steps + 1):
            ids = batch(500 + step, sequences, seq_len, model.config.vocab_size, common=16)
            spent.update(a2a=0.0, moe=0.0)
            tdist.barrier()
            t0 = time.perf_counter()
            model.zero_grad()
            (lm_loss(model, ids) / ctx.world_size).backward()
            total = time.perf_counter() - t0
            if step:                                     # the first is a warm-up
                rows.append((total, spent["a2a"], spent["moe"] - spent["a2a"]))
    finally:
        tdist.all_to_all_single = original
        for h in hooks:
            h.remove()

    def summary(i):
        vals = sorted(r[i] for r in rows)
        return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1]}

    step, a2a, moe = summary(0), summary(1), summary(2)
    return {"step": step, "all_to_all": a2a, "moe_compute": moe,
            "a2a_share": a2a["median"] / step["median"]}


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS + ("all",), default="all")
    parser.add_argument("--steps", type=int, default=200, help="training steps of 'balance'")
    parser.add_argument("--sequences", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--aux", type=float, default=0.1,
                        help="auxiliary loss coefficient of 'balance' (default 0.1)")
    args = parser.parse_args(argv)
    for name in ("steps", "sequences", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    ctx = dist.setup("gloo", seed=0)
    if 8 % ctx.world_size:
        raise SystemExit(f"the debug-moe model has 8 experts: run on 1, 2, 4 or 8 ranks, not "
                         f"{ctx.world_size}")
    parts = PARTS if args.part == "all" else (args.part,)
    out = {}
    if "parity" in parts:
        out["parity"] = [parity(ctx, ctx.world_size, args.sequences, args.seq_len)]
        if ctx.world_size == 4:
            out["parity"].append(parity(ctx, 2, args.sequences, args.seq_len))
    if "balance" in parts:
        out["balance"] = [balance(ctx, args.steps, args.sequences, args.seq_len, c)
                          for c in (0.0, args.aux)]
    if "capacity" in parts:
        out["capacity"] = capacity_part(ctx, args.sequences, args.seq_len,
                                        (0.5, 1.0, 1.25, 2.0))
    if "time" in parts:
        out["time"] = timing(ctx, 10, args.sequences, args.seq_len)
    if ctx.rank == 0:
        _print(out)
    dist.report(**out)
    dist.shutdown()


def _print(out: dict) -> None:
    for r in out.get("parity", []):
        print(f"parity, EP {r['ep']} x EDP {r['edp']}: loss {r['loss']:.6f} vs one process "
              f"{r['loss_reference']:.6f} (transformers' Mixtral blocks: "
              f"{r['loss_transformers']:.6f}); max |grad diff| dense "
              f"{r['max_grad_diff']['dense']:.1e}, experts {r['max_grad_diff']['experts']:.1e}; "
              f"all-to-all {r['all_to_all_calls']} calls per rank, "
              f"{r['all_to_all_bytes_all_ranks']:,.0f} B sent by all ranks vs predicted "
              f"{r['predicted_calls']} calls, {r['predicted_bytes']:,.0f} B per rank "
              f"(ratio {r['bytes_ratio']:.3f})")
    for r in out.get("balance", []):
        print(f"balance, aux {r['aux_coef']:g}, {r['steps']} steps: tokens per expert max/mean "
              f"per layer at step 1 " + ", ".join(f"{x:.2f}" for x in r["imbalance_first"])
              + "; last tenth " + ", ".join(f"{x:.2f}" for x in r["imbalance_last"]))
    for r in out.get("capacity", []):
        print(f"capacity factor {r['capacity_factor']:g}, layer {r['layer']}: capacity "
              f"{r['capacity']} per expert, dropped {r['dropped']} of {r['assignments']} "
              f"assignments ({r['share']:.1%}) vs {r['predicted']} from the router's counts; a "
              f"balanced router would drop {r['balanced_share']:.0%}")
    if "time" in out:
        t = out["time"]

        def fmt(d):
            return f"{d['median'] * 1e3:.1f} ms ({d['min'] * 1e3:.1f}-{d['max'] * 1e3:.1f})"
        print(f"time per step {fmt(t['step'])}: all-to-all {fmt(t['all_to_all'])}, the rest of "
              f"the MoE blocks {fmt(t['moe_compute'])}; all-to-all {t['a2a_share']:.0%} of the "
              "step (CPU, gloo)")


if __name__ == "__main__":
    main()
