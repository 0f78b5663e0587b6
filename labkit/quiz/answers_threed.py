"""Answers of the 3D-parallelism questions (labkit/quiz/data/threed.yaml).

A layout's GPU count is `labkit.planner.Layout.gpus` (tp x pp x dp x cp); its memory and
feasibility come from `labkit.planner.evaluate` / `plan` / `degree_problem`; ring attention's
traffic from `labkit.comm.step_communication("cp")`. Which ranks share a group is computed here
by `mesh_groups`, a pure function (labkit.parallel.mesh is a higher layer), with Megatron-LM's
rank order: TP innermost, then CP, DP, and PP outermost,
rank = ((pp_i x dp + dp_i) x cp + cp_i) x tp + tp_i.
"""
from __future__ import annotations

import functools
import itertools

from labkit import validate
from labkit.comm import step_communication
from labkit.hardware import GB, get_link
from labkit.memory import estimate_memory
from labkit.models import get_model
from labkit.planner import Layout, degree_problem, evaluate, plan

AXES = ("pp", "dp", "cp", "tp")          # outermost to innermost (Megatron-LM's order)
MB = 1e6


def mesh_groups(tp=1, cp=1, dp=1, pp=1) -> dict[str, list[list[int]]]:
    """{axis: [group, ...]} for the four axes: the ranks that differ only along that axis,
    ascending, groups ordered by the other coordinates."""
    sizes = {a: validate.positive_int(a, v, validate.MAX_RANKS)
             for a, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp))}
    world = sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]
    if world > 65536:
        raise ValueError(f"tp x cp x dp x pp = {world:,} ranks; allowed: up to 65,536 (the "
                         "groups are listed rank by rank)")

    return grid_groups(sizes, AXES)


def grid_groups(sizes: dict, axes: tuple, listed=None) -> dict[str, list[list[int]]]:
    """{axis: groups} of a row-major grid of ranks whose `axes` (outermost first) have `sizes`:
    for each axis (of `listed`, default all) the ranks that differ only along it."""
    def rank(c):
        r = 0
        for a in axes:
            r = r * sizes[a] + c[a]
        return r

    out = {}
    for axis in listed or axes:
        others = [a for a in axes if a != axis]
        groups = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            c = dict(zip(others, fixed))
            groups.append(sorted(rank({**c, axis: i}) for i in range(sizes[axis])))
        out[axis] = sorted(groups)
    return out


def group_of(rank, axis, **degrees) -> list[int]:
    """The `axis` group that holds `rank`."""
    groups = mesh_groups(**degrees)
    validate.choice("axis", axis, AXES)
    world = sum(len(g) for g in groups[axis])
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} must be a whole number from 0 to {world - 1}")
    return next(g for g in groups[axis] if rank in g)


def layout_gpus(tp, pp, dp, cp=1):
    """GPUs a layout needs: the product of its degrees."""
    lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp)
    return {"answer": lay.gpus, "layout": str(lay).split(" ddp")[0]}


def dp_degree(gpus, tp, pp, cp=1):
    """Data-parallel degree that fills `gpus` GPUs with tp x pp x cp model replicas' shards."""
    n = validate.positive_int("gpus", gpus, validate.MAX_RANKS)
    per_replica = Layout(tp=tp, pp=pp, cp=cp).gpus
    if n % per_replica:
        raise ValueError(f"gpus={n:,} is not a multiple of tp x pp x cp = {per_replica}; "
                         "allowed: a multiple of it")
    return {"answer": n // per_replica, "replica": per_replica}


def tp_group_first(rank, tp, dp, pp):
    """Lowest rank of the TP group holding `rank`."""
    g = group_of(rank, "tp", tp=tp, dp=dp, pp=pp)
    return {"answer": g[0], "group": ", ".join(map(str, g)), "last": g[-1]}


def pp_next_rank(rank, tp, dp, pp):
    """The rank holding the next pipeline stage of `rank`'s shard (same tp, cp, dp index)."""
    g = group_of(rank, "pp", tp=tp, dp=dp, pp=pp)
    i = g.index(rank)
    if i == len(g) - 1:
        allowed = (f"ranks 0 to {(g[1] - g[0]) * (len(g) - 1) - 1}" if len(g) > 1
                   else "pp >= 2")
        raise ValueError(f"rank={rank} is on the last pipeline stage, which has no next one; "
                         f"allowed: {allowed}")
    return {"answer": g[i + 1], "stride": g[1] - g[0], "group": ", ".join(map(str, g))}


def dp_nodes(tp, dp, pp, gpus_per_node=8):
    """Most nodes one data-parallel group spans (ranks r // gpus_per_node on one node)."""
    groups = mesh_groups(tp=tp, dp=dp, pp=pp)
    spans = [len({r // gpus_per_node for r in g}) for g in groups["dp"]]
    tp_spans = [len({r // gpus_per_node for r in g}) for g in groups["tp"]]
    first = groups["dp"][0]
    return {"answer": max(spans), "tp_nodes": max(tp_spans), "first": ", ".join(map(str, first))}


def verify_tp_innermost(tp, dp, pp, gpus_per_node=8):
    """With TP innermost, every TP group is tp consecutive ranks inside one node (NVLink) while
    the DP groups cross nodes; the node's NVLink is many times an IB NDR port."""
    out = dp_nodes(tp, dp, pp, gpus_per_node)
    nv, ib = get_link("nvlink4"), get_link("ib-ndr")
    holds = out["tp_nodes"] == 1 and out["answer"] > 1
    return {"holds": holds, "dp_nodes": out["answer"], "bw_ratio": nv.bandwidth / ib.bandwidth,
            "tp_group": ", ".join(map(str, mesh_groups(tp=tp, dp=dp, pp=pp)["tp"][0])),
            "dp_group": out["first"]}


def layout_memory_gb(model, tp, pp, dp, recompute, global_batch=256, seq_len=4096,
                     gpu="h100-sxm"):
    """GB per GPU (worst stage) of a ZeRO-1 layout, micro-batch 1, as the planner prices it
    (production kernels' activations, labkit.activations "fused"), against what is usable."""
    e = evaluate(model, Layout(tp=tp, pp=pp, dp=dp, sharding="zero1", recompute=recompute),
                 gpu=gpu, global_batch=global_batch, seq_len=seq_len)
    m = estimate_memory(model, batch_size=1, seq_len=seq_len, zero_stage=1, dp=dp, tp=tp, pp=pp,
                        recompute=recompute, microbatches=e.microbatches, implementation="fused")
    return {"answer": m.total / GB, "states_gb": m.model_states / GB,
            "act_gb": m.activations / GB, "m": e.microbatches, "capacity_gb": e.capacity / GB,
            "usable_gb": e.usable / GB, "planner_gb": e.memory / GB,
            "fits": "fits" if e.fits else "does NOT fit", "held": min(pp, e.microbatches)}


def verify_seed_recommender():
    """A popular article's recommender for 70B on 64 A100-80GB (FSDP over dp = 64 // 8) does
    not fit and leaves most GPUs idle; the planner finds a layout on all 64 that fits. (Computed
    once: `plan` takes about a second.)"""
    return dict(_seed_recommender())


@functools.lru_cache(maxsize=1)
def _seed_recommender():
    gpus, gpu = 64, "a100-80gb"
    seed = evaluate("llama2-70b", Layout(dp=gpus // 8, sharding="fsdp", recompute="full"),
                    gpu=gpu, global_batch=64, seq_len=4096)
    best = plan("llama2-70b", gpus, gpu=gpu, global_batch=64, seq_len=4096).best
    holds = (not seed.fits) and best is not None and best.fits and best.layout.gpus == gpus
    return {"holds": holds, "seed_gb": seed.memory / GB, "idle": gpus - seed.layout.gpus,
            "used": seed.layout.gpus, "best": str(best.layout) if best else "none",
            "best_gb": best.memory / GB if best else 0.0, "capacity_gb": seed.capacity / GB,
            "states_gb": estimate_memory(get_model("llama2-70b").num_params(), zero_stage=3,
                                         dp=seed.layout.gpus).model_states / GB}


def verify_tp_across_nodes(model, tp, gpus_per_node=8, seq_len=4096):
    """The planner rejects a tp larger than a node first, with the reason 'tp across nodes'."""
    why = degree_problem(get_model(model), Layout(tp=tp), gpus_per_node, seq_len)
    nv, ib = get_link("nvlink4"), get_link("ib-ndr")
    return {"holds": bool(why) and why.startswith("tp across nodes"), "reason": why or "",
            "bw_ratio": nv.bandwidth / ib.bandwidth}


def cp_mb_per_layer(model, cp, seq_len, tp=1):
    """MB one context-parallel rank sends per layer and micro-batch (forward + backward) in
    ring attention: 3 (cp - 1) blocks of K and V (and dK, dV) of 2 b (s/cp) kv_size/tp x 2 B."""
    spec = get_model(model)
    c = step_communication("cp", model=spec, cp=cp, tp=tp, seq_len=seq_len)
    send = c.collectives[0]
    return {"answer": c.total_bytes / spec.num_layers / MB, "block_mb": send.nbytes / MB,
            "sends": send.count // spec.num_layers, "kv": spec.kv_size,
            "tokens": seq_len // cp}
