"""Answers of the mixture-of-experts questions (labkit/quiz/data/moe.yaml).

Counts from `labkit.models` (active_params, expert_params), states from
`labkit.memory.estimate_memory(ep=)` (experts over ep, ZeRO over edp = tp dp / (ep etp)),
FLOPs from `labkit.flops.flops_per_token` (active parameters), the all-to-alls from
`labkit.comm.step_communication("ep")` and `collective_time`. GShard's capacity and the
Switch / GShard auxiliary loss are pure functions here (`capacity`, `aux_loss`), the formulas of
labkit.parallel.expert, a higher layer; so is the expert mesh (`expert_groups`), Megatron-LM's
order: rank = p (tp cp dp) + (d ep + e) etp + t.
"""
from __future__ import annotations

import math

from labkit import validate
from labkit.comm import collective_time, step_communication
from labkit.flops import flops_per_token
from labkit.hardware import GB, get_link
from labkit.memory import estimate_memory, state_bytes
from labkit.models import get_model
from labkit.placement import model_states, stage_expert_params, stage_params
from labkit.precision import gradient_bytes
from labkit.quiz.answers_threed import grid_groups

MB = 1e6
ROUTINGS = ("uniform", "two-experts", "one-expert")
LINK_PAIR = ("nvlink4", "ib-ndr")


def _moe(model):
    spec = get_model(model)
    if not spec.is_moe:
        raise ValueError(f"model={spec.name!r} is dense; allowed: a mixture-of-experts preset "
                         "(mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, debug-moe)")
    return spec


def _sizes(spec) -> dict:
    """A preset's MoE shape, for the explanations."""
    return {"total_b": spec.num_params() / 1e9, "active_b": spec.active_params() / 1e9,
            "E": spec.num_experts, "k": spec.experts_per_token, "h": spec.hidden_size,
            "f": spec.expert_ffn, "expert_m": spec.expert_params() / 1e6,
            "moe_layers": spec.moe_layers, "dense_layers": spec.dense_layers,
            "shared": spec.shared_experts,
            "experts_b": spec.param_breakdown()["experts"] / 1e9}


# ---- parameters and FLOPs ---------------------------------------------------------------------

def active_params_b(model):
    """Parameters one token uses, in billions: all but the routed experts it is not sent to."""
    spec = _moe(model)
    out = _sizes(spec)
    idle = spec.num_params() - spec.active_params()
    return {**out, "answer": spec.active_params() / 1e9, "idle_b": idle / 1e9,
            "idle_per_layer": spec.num_experts - spec.experts_per_token}


def expert_params_m(model):
    """One routed expert (a SwiGLU MLP, gate + up + down, no biases): 3 h f_e, in millions."""
    spec = _moe(model)
    out = _sizes(spec)
    return {**out, "answer": spec.expert_params() / 1e6,
            "experts_pct": 100 * out["experts_b"] / out["total_b"]}


def _flops(spec, seq_len):
    mine = flops_per_token(spec, seq_len)
    dense = flops_per_token(spec.with_(experts_per_token=spec.num_experts), seq_len)
    return mine, dense


def dense_flops_ratio(model, seq_len):
    """Training FLOPs per token if every token went through every routed expert (a dense model
    of the same total size) over the MoE's own, both from labkit.flops (6 N_active + attention)."""
    spec = _moe(model)
    mine, dense = _flops(spec, seq_len)
    return {**_sizes(spec), "answer": dense / mine, "gflop": mine / 1e9,
            "dense_gflop": dense / 1e9}


def verify_flops_follow_active(model, seq_len):
    """FLOPs per token follow the active parameters (far fewer than the dense equivalent's), the
    model states the total (16 B x num_params unsharded)."""
    spec = _moe(model)
    mine, dense = _flops(spec, seq_len)
    states = estimate_memory(spec, seq_len=seq_len).model_states
    holds = (mine < dense / 2 and spec.active_params() < spec.num_params() / 2
             and math.isclose(states, 16 * spec.num_params()))
    return {**_sizes(spec), "holds": holds, "gflop": mine / 1e9, "dense_gflop": dense / 1e9,
            "states_gb": states / GB, "ratio": dense / mine}


def verify_memory_not_active(model, ep):
    """Model states follow the total parameters: 16 B x total unsharded (far above 16 B x the
    active ones), and with ep ranks the dense states plus the routed experts / ep."""
    spec = _moe(model)
    one = estimate_memory(spec, seq_len=4096).model_states
    split = estimate_memory(spec, seq_len=4096, dp=ep, ep=ep).model_states
    active = 16 * spec.active_params()
    dense = 16 * (spec.num_params() - spec.param_breakdown()["experts"])
    holds = (math.isclose(one, 16 * spec.num_params()) and one > 2 * active
             and math.isclose(split, dense + (one - dense) / ep))
    return {**_sizes(spec), "holds": holds, "states_gb": one / GB, "active_gb": active / GB,
            "ep_gb": split / GB}


# ---- memory: experts over ep, ZeRO over edp ----------------------------------------------------

def _placed(n, zero_stage, group) -> float:
    """Bytes of model states of n parameters, bf16 mixed AdamW, ZeRO-sharded over `group`."""
    w, _, o = state_bytes("bf16-mixed", "adamw")
    return sum(model_states(n, w, gradient_bytes(w, "param"), o, zero_stage, group)[0].values())


def _states(model, dp, ep, zero_stage, tp=1):
    """(spec, estimate, dense bytes, expert bytes, edp) of the model states per GPU, bf16 mixed
    AdamW, checked against estimate_memory's total."""
    spec = _moe(model)
    m = estimate_memory(spec, seq_len=4096, dp=dp, tp=tp, ep=ep, zero_stage=zero_stage)
    edp = len(expert_groups(tp=tp, dp=dp, ep=ep)["edp"][0])
    dense = _placed(stage_params(spec, tp, 1, experts=False)[0], zero_stage, dp)
    experts = _placed(stage_expert_params(spec, 1, ep)[0], zero_stage, edp)
    if not math.isclose(dense + experts, m.model_states):      # the split is estimate_memory's
        raise ValueError(f"dense {dense} + experts {experts} != estimate_memory's "
                         f"{m.model_states}")
    return spec, m, dense, experts, edp


def expert_states_gb(model, dp, ep):
    """GB of the routed experts' model states (16 B/param, no ZeRO) on each GPU at ep."""
    spec, m, dense, experts, edp = _states(model, dp, ep, 0)
    one = _states(model, dp, 1, 0)[3]
    return {**_sizes(spec), "answer": experts / GB, "per_gpu_b": experts / 16 / 1e9,
            "ep1_gb": one / GB, "dense_gb": dense / GB, "total_gb": m.model_states / GB}


def states_per_gpu_gb(model, dp, ep, zero_stage=1):
    """GB of model states per GPU: dense states ZeRO-sharded over dp, experts / ep and ZeRO-
    sharded over edp = dp / ep (tp = 1)."""
    spec, m, dense, experts, edp = _states(model, dp, ep, zero_stage)
    dense_params = stage_params(spec, 1, 1, experts=False)[0]
    expert_params = stage_expert_params(spec, 1, ep)[0]
    naive = dense + _placed(expert_params, zero_stage, dp)     # experts sharded over dp: wrong
    return {**_sizes(spec), "answer": m.model_states / GB, "dense_gb": dense / GB,
            "experts_gb": experts / GB, "edp": edp, "dense_b": dense_params / 1e9,
            "per_gpu_b": expert_params / 1e9, "naive_gb": naive / GB}


# ---- the expert mesh -------------------------------------------------------------------------

def expert_groups(tp=1, cp=1, dp=1, pp=1, ep=1, etp=1) -> dict[str, list[list[int]]]:
    """{axis: groups} of the expert layers (axes edp, ep, etp): within each pipeline stage its
    tp cp dp ranks laid out again as edp x ep x etp, etp innermost (Megatron-LM)."""
    d = {a: validate.positive_int(a, v, validate.MAX_RANKS)
         for a, v in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp), ("ep", ep), ("etp", etp))}
    stage = d["tp"] * d["cp"] * d["dp"]
    if stage % (d["ep"] * d["etp"]):
        raise ValueError(f"ep x etp = {ep} x {etp} does not divide tp x cp x dp = {stage}; "
                         "allowed: ep x etp a divisor of it")
    if stage * d["pp"] > 65536:
        raise ValueError(f"{stage * d['pp']:,} ranks; allowed: up to 65,536")
    sizes = {"pp": d["pp"], "edp": stage // (d["ep"] * d["etp"]), "ep": d["ep"], "etp": d["etp"]}
    # outermost to innermost: pp, then edp, ep, etp
    return grid_groups(sizes, ("pp", "edp", "ep", "etp"), listed=("edp", "ep", "etp"))


def _show(groups) -> str:
    return ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups)


def edp_degree(tp, dp, ep, pp=1):
    """Ranks that hold the same experts (the expert-data-parallel group ZeRO shards them over):
    tp x dp / ep with etp = 1."""
    g = expert_groups(tp=tp, dp=dp, pp=pp, ep=ep)
    return {"answer": len(g["edp"][0]), "stage": tp * dp, "ep_group": _show(g["ep"][:1]),
            "edp_group": _show(g["edp"][:1])}


def verify_ep_groups(dp, ep):
    """On dp ranks (tp = pp = 1) the ep groups are ep consecutive ranks, the edp groups those ep
    apart; each ep group meets each edp group in exactly one rank."""
    g = expert_groups(dp=dp, ep=ep)
    consecutive = all(grp == list(range(grp[0], grp[0] + ep)) for grp in g["ep"])
    meet = all(len(set(a) & set(b)) == 1 for a in g["ep"] for b in g["edp"])
    every = sorted(r for grp in g["ep"] for r in grp) == list(range(dp))
    return {"holds": consecutive and meet and every and 1 < ep < dp,
            "ep_groups": _show(g["ep"]), "edp_groups": _show(g["edp"]),
            "edp": len(g["edp"][0])}


def verify_edp_shards_experts(model, tp, dp, ep):
    """ZeRO-1 shards the dense optimizer states over dp and the routed experts' over edp (the
    ranks holding the same experts), as estimate_memory counts them."""
    spec = _moe(model)
    edp = len(expert_groups(tp=tp, dp=dp, ep=ep)["edp"][0])
    kw = dict(seq_len=4096, tp=tp, dp=dp, ep=ep)
    z0, z1 = (estimate_memory(spec, zero_stage=z, **kw) for z in (0, 1))
    expert_opt = 12 * stage_expert_params(spec, 1, ep)[0]
    dense_opt = z0.optimizer_states - expert_opt
    holds = math.isclose(z1.optimizer_states, dense_opt / dp + expert_opt / edp) and edp < dp
    return {"holds": holds, "edp": edp, "experts_here": spec.num_experts // ep,
            "expert_opt_gb": expert_opt / edp / GB, "wrong_gb": expert_opt / dp / GB,
            "dense_opt_gb": dense_opt / dp / GB}


# ---- routing: capacity, drops, the auxiliary loss ----------------------------------------------

def capacity(tokens, k, num_experts, capacity_factor) -> int:
    """GShard / Switch's expert capacity: ceil(capacity_factor x tokens x k / num_experts)
    assignments per expert (labkit.parallel.expert.capacity)."""
    t = validate.positive_int("tokens", tokens, 2**40)
    k = validate.positive_int("k", k, 2**16)
    e = validate.positive_int("num_experts", num_experts, 2**16)
    if k > e:
        raise ValueError(f"k={k} is more than num_experts={e}; allowed: 1 to {e}")
    cf = validate.positive("capacity_factor", capacity_factor, 1e6)
    return math.ceil(cf * t * k / e)


def expert_capacity(tokens, k, experts, cf):
    """Token slots per expert for a batch of `tokens` routed top-k at capacity factor cf."""
    cap = capacity(tokens, k, experts, cf)
    return {"answer": cap, "exact": cf * tokens * k / experts, "share": tokens * k / experts,
            "assignments": tokens * k}


def dropped_pct(tokens, k, experts, cf):
    """% of the assignments dropped when the router is perfectly balanced (each expert receives
    tokens x k / experts) and each expert keeps `capacity` of them."""
    if (tokens * k) % experts:
        raise ValueError(f"tokens x k = {tokens * k} is not a multiple of experts={experts}; "
                         "allowed: a balanced router needs a whole share per expert")
    share = tokens * k // experts
    cap = capacity(tokens, k, experts, cf)
    kept = min(share, cap)
    return {"answer": 100 * (share - kept) / share, "share": share, "cap": cap,
            "dropped": share - kept, "total_dropped": (share - kept) * experts,
            "assignments": tokens * k}


def aux_loss(shares, probs) -> float:
    """The Switch Transformer's load-balancing loss without its coefficient (Fedus et al. 2021,
    eq. 4): E x sum_e f_e P_e, f_e the share of assignments to expert e, P_e its mean router
    probability (labkit.parallel.expert.TopKRouter)."""
    if len(shares) != len(probs) or not shares:
        raise ValueError("shares and probs need one value per expert")
    return len(shares) * sum(f * p for f, p in zip(shares, probs))


def aux_loss_value(experts, routing):
    """The auxiliary loss for `routing`: "uniform" (every expert 1/E of the assignments and of
    the probability), "two-experts" (two experts take half each), "one-expert" (collapse)."""
    e = validate.positive_int("experts", experts, 2**16)
    validate.choice("routing", routing, ROUTINGS)
    hot = {"uniform": e, "two-experts": 2, "one-expert": 1}[routing]
    if hot > e:
        raise ValueError(f"routing={routing!r} needs at least {hot} experts")
    vec = [1 / hot] * hot + [0.0] * (e - hot)
    return {"answer": aux_loss(vec, vec), "hot": hot, "f": 1 / hot, "terms": hot}


# ---- expert parallelism's all-to-alls ---------------------------------------------------------

def _a2a(model, ep, seq_len, batch=1, microbatches=1, cf=None, recompute="none", pp=1):
    spec = _moe(model)
    c = step_communication("ep", spec, ep=ep, pp=pp, seq_len=seq_len, batch_size=batch,
                           microbatches=microbatches, capacity_factor=cf, recompute=recompute)
    (a2a,) = c.collectives
    return spec, a2a


def a2a_mb_per_layer(model, ep, seq_len, batch, cf):
    """MB this rank's all-to-all send buffers hold per MoE layer and micro-batch: dispatch and
    combine, forward and backward, each tokens x k x cf x h x 2 B (bf16)."""
    spec, a = _a2a(model, ep, seq_len, batch, cf=cf)
    per_layer = a.count // spec.moe_layers
    total = per_layer * a.nbytes
    return {**_sizes(spec), "answer": total / MB, "buf_mb": a.nbytes / MB, "passes": per_layer,
            "tokens": batch * seq_len, "leaves_mb": total * (ep - 1) / ep / MB}


def a2a_count(model, ep, pp, microbatches, recompute):
    """All-to-alls per training step on a rank of the first pipeline stage: 4 per MoE layer it
    holds and micro-batch (6 with full recompute, which reruns the forward's two)."""
    spec, a = _a2a(model, ep, 4096, microbatches=microbatches, recompute=recompute, pp=pp)
    layers = round(stage_expert_params(spec, pp)[0] / (spec.num_experts * spec.expert_params()))
    return {**_sizes(spec), "answer": a.count, "layers": layers, "layers_all": spec.num_layers,
            "per_layer": a.count // (layers * microbatches)}


def a2a_ms(model, ep, seq_len, link):
    """ms of one dispatch all-to-all (one sequence of seq_len tokens, bf16, no capacity factor)
    on `link`, alpha-beta: (ep - 1) alpha + (ep - 1)/ep S / B; the other link's time beside it."""
    validate.choice("link", link, LINK_PAIR)
    spec, a = _a2a(model, ep, seq_len)

    def ms(name):
        L = get_link(name)
        return 1e3 * collective_time("all_to_all", a.nbytes, ep, L.bandwidth, L.latency)

    other = next(x for x in LINK_PAIR if x != link)
    t, t_other = ms(link), ms(other)
    return {**_sizes(spec), "answer": t, "size_mb": a.nbytes / MB, "other": other,
            "other_ms": t_other, "bw_gb": get_link(link).bandwidth / GB,
            "name": get_link(link).name, "other_name": get_link(other).name,
            "slower": max(t, t_other) / min(t, t_other), "count": a.count,
            "per_mb_ms": t * a.count}
