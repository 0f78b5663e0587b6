"""Collective costs: alpha-beta times, nccl-tests' algbw/busbw, and what each strategy sends.

    >>> collective_time("all_reduce", 1e9, 8, bandwidth=450e9, latency=5e-6)   # seconds
    >>> step_communication("zero3", "llama2-7b", dp=8).by_op    # {op: (count, bytes sent)}

`nbytes` (S) is always the size of the *whole* buffer of the operation, as in nccl-tests
(NVIDIA/nccl-tests, doc/PERFORMANCE.md; what that is per op: above `OPS`). Times are alpha-beta:
t = steps * alpha + bytes on the busiest link / bandwidth (Hockney 1994; Thakur, Rabenseifner and
Gropp 2005 for the ring and tree algorithms), `bandwidth` per rank per direction, `latency` =
alpha per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math

from labkit import validate

# The size convention (nccl-tests'), the same everywhere in this module: `nbytes` (S) is
# - all_reduce, broadcast, reduce: the buffer each rank holds;
# - all_gather: the gathered output (n x each rank's input);
# - reduce_scatter: the input before scattering (n x each rank's output);
# - all_to_all: each rank's whole send buffer (n chunks of S / n);
# - send_recv: the message.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
       "send_recv")
ALGORITHMS = ("ring", "tree")
_TREE_OPS = ("all_reduce", "broadcast", "reduce")


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw factor for `op` on `world_size` ranks.

    nccl-tests: algbw = S / t; busbw = algbw x factor, with factor 2(n-1)/n for all_reduce,
    (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast, reduce and
    send_recv. busbw is the per-rank, per-direction link speed a ring-optimal algorithm would
    need, so it can be compared with `labkit.hardware.LINKS[...].bandwidth` whatever n is."""
    validate.choice("op", op, OPS)
    n = validate.positive_int("world_size", world_size, validate.MAX_RANKS)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(nbytes, seconds) -> float:
    """nccl-tests' algorithm bandwidth S / t, bytes/s."""
    S = validate.non_negative("nbytes", nbytes, validate.MAX_BYTES)
    return S / validate.at_least("seconds", validate.positive("seconds", seconds),
                                 validate.MIN_SECONDS)


algorithm_bandwidth = algbw


def bus_bandwidth(op, nbytes, seconds, world_size) -> float:
    """nccl-tests' bus bandwidth, bytes/s: algbw x bus_factor(op, world_size)."""
    return algbw(nbytes, seconds) * bus_factor(op, world_size)


def bytes_sent_per_rank(op, nbytes, world_size) -> float:
    """Bytes each rank sends (and receives) under the ring algorithm: all_reduce 2(n-1)/n S,
    all_gather / reduce_scatter / all_to_all (n-1)/n S, broadcast / reduce S (a pipelined chain;
    the last rank sends nothing, the others S), send_recv S. Equal to S x bus_factor."""
    n = validate.positive_int("world_size", world_size, validate.MAX_RANKS)
    S = validate.non_negative("nbytes", nbytes, validate.MAX_BYTES)
    return 0.0 if n == 1 else S * bus_factor(op, n)


def collective_time(op, nbytes, world_size, bandwidth, latency=0.0, algorithm="ring") -> float:
    """Seconds for one collective under the alpha-beta model.

    ring (n ranks, S = nbytes as noted above `OPS`, B = bandwidth, alpha = latency):
      all_reduce                  2(n-1) alpha + 2(n-1)/n S/B   (reduce-scatter + all-gather)
      all_gather, reduce_scatter  (n-1) alpha + (n-1)/n S/B
      all_to_all                  (n-1) alpha + (n-1)/n S/B     (pairwise exchange, full bisection)
      broadcast, reduce           (n-1) alpha + S/B             (pipelined chain, S >> chunk)
      send_recv                   alpha + S/B
    tree (two pipelined binary trees, Sanders, Speck and Traeff 2009; NCCL's "double binary
    tree" uses them for all_reduce only, and runs broadcast and reduce as rings):
      all_reduce                  2 ceil(log2 n) alpha + 2 S/B  (reduce up, broadcast down, each
                                  rank sends S/2 per tree per phase over two trees)
      broadcast, reduce           ceil(log2 n) alpha + S/B
    With these, bus_bandwidth(op, S, collective_time(op, S, n, B), n) == B for every ring op at
    zero latency. world_size 1 costs nothing.
    """
    validate.choice("op", op, OPS)
    validate.choice("algorithm", algorithm, ALGORITHMS)
    n = validate.positive_int("world_size", world_size, validate.MAX_RANKS)
    S = validate.non_negative("nbytes", nbytes, validate.MAX_BYTES)
    B = validate.at_least("bandwidth", validate.positive("bandwidth", bandwidth),
                          validate.MIN_BANDWIDTH)
    a = validate.non_negative("latency", latency, validate.MAX_LATENCY)
    if n == 1:
        return 0.0
    if algorithm == "tree":
        if op not in _TREE_OPS:
            allowed = ", ".join(repr(o) for o in _TREE_OPS)
            raise ValueError(f"algorithm='tree' is not defined for op={op!r}; allowed ops for "
                             f"tree: {allowed} (use algorithm='ring')")
        depth = math.ceil(math.log2(n))
        if op == "all_reduce":
            return 2 * depth * a + 2 * S / B
        return depth * a + S / B
    steps = {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(op, n - 1)
    return steps * a + bytes_sent_per_rank(op, S, n) / B


# ---- communication per training step ---------------------------------------------------------

@dataclass
class Collective:
    op: str
    count: int          # how many times per step
    nbytes: float       # payload of each, nccl-tests' S
    group: int          # ranks taking part
    why: str = ""

    @property
    def sent(self) -> float:
        """Bytes this rank sends for all `count` of them (ring algorithm)."""
        return self.count * bytes_sent_per_rank(self.op, self.nbytes, self.group)


@dataclass
class StepComm:
    """Communication of one rank in one training step.

    by_op:   {op: (count, bytes sent per rank)}   bytes on the wire, ring algorithms
    payload: {op: (count, payload bytes)}         sum of nccl-tests' S (tensor sizes passed in)
    total_bytes: sum of the bytes sent per rank over all ops.
    """

    strategy: str
    collectives: list = field(default_factory=list)
    notes: str = ""

    def _sum(self, attr):
        out: dict = {}
        for c in self.collectives:
            count, value = out.get(c.op, (0, 0.0))
            add = c.sent if attr == "sent" else c.count * c.nbytes
            out[c.op] = (count + c.count, value + add)
        return out

    @property
    def by_op(self) -> dict:
        return self._sum("sent")

    @property
    def payload(self) -> dict:
        return self._sum("payload")

    @property
    def total_bytes(self) -> float:
        return sum(c.sent for c in self.collectives)

    @property
    def total_payload(self) -> float:
        return sum(c.count * c.nbytes for c in self.collectives)

    def time(self, bandwidth, latency=0.0, algorithm="ring") -> float:
        """Seconds if every collective ran back to back (no overlap with compute)."""
        return sum(c.count * collective_time(c.op, c.nbytes, c.group, bandwidth, latency,
                                             algorithm if c.op in _TREE_OPS else "ring")
                   for c in self.collectives)


STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "pp", "cp", "ep")
RECOMPUTE = ("none", "selective", "full")


def step_communication(strategy, model=None, num_params=None, dp=1, tp=1, pp=1, cp=1,
                       batch_size=1, seq_len=None, microbatches=1, sequence_parallel=False,
                       recompute="none", param_bytes=4, grad_bytes=4, activation_bytes=2,
                       units=None, reshard_after_forward=True, chunks=1,
                       sp_regather=False, ep=1, capacity_factor=None) -> StepComm:
    """What one rank communicates in one training step under `strategy` (the busiest rank).

    Data parallel (group dp; Psi = parameters this rank's replica holds, i.e. / (tp x pp)):
    - "ddp": one all_reduce of the gradients, Psi x grad_bytes (PyTorch DDP buckets it; the
      total is the same). Gradients are accumulated locally over micro-batches.
    - "zero1", "zero2": reduce_scatter of the gradients + all_gather of the updated weights:
      the same 2 Psi volume as DDP's all-reduce (Rajbhandari et al. 2020, §7.2.1). With
      micro-batches, ZeRO-1 accumulates full gradients and reduces once per step, but ZeRO-2
      keeps only its 1/dp gradient shard, so it must reduce_scatter after every micro-batch's
      backward (m reduce_scatters; DeepSpeed's engine: "ZeRO stage >= 2 communicates during
      non gradient accumulation boundaries as well"); this is what `labkit.memory` assumes
      when it divides ZeRO-2's gradients by dp.
    - "zero3": per micro-batch, all_gather of the weights for the forward, again for the
      backward, and reduce_scatter of the gradients: 3 Psi, 1.5x DDP (§7.2.2).
    - "fsdp": ZeRO-3 per wrapping unit. With a model: one unit per transformer layer plus the
      root (embeddings, final norm, head), and like FSDP2 the root keeps its weights after the
      forward (no backward all_gather); with `units=k` and a parameter count: k equal units.
      reshard_after_forward=False drops the backward all-gathers (ZeRO-2-like).
    Tensor parallel (group tp; Megatron-LM, Shoeybi et al. 2019, §3; Korthikanti et al. 2022):
    - "tp": per layer and micro-batch, 2 all_reduce in the forward (after attention and MLP)
      and 2 in the backward (the conjugate f operators), each b x s x h x activation_bytes.
      With sequence_parallel each all_reduce becomes an all_gather + reduce_scatter of the same
      S (same bytes on the wire): the paper's minimum (Korthikanti et al. 2022, §4.2.2), 4
      all_gathers + 4 reduce_scatters per layer. Megatron-LM saves only its 1/tp slice of each
      column-parallel linear's input and re-gathers it in the backward for the weight gradient:
      sp_regather=True counts that implementation, 6 all_gathers + 4 reduce_scatters per layer.
      recompute="full" repeats the forward's collectives. The
      vocab-parallel embedding and loss (one all-reduce of b s h each way, plus tiny ones) are
      not counted.
    - "pp": send/recv of b x s x h x activation_bytes per micro-batch and stage boundary,
      activations forward and their gradients backward (Narayanan et al. 2021); with
      `chunks` > 1 (interleaved) a micro-batch crosses each rank `chunks` times. With
      sequence_parallel Megatron sends each tp rank's 1/tp slice (scatter-gather).
    - "cp": ring attention (Liu et al. 2023; Megatron-LM context parallelism): per layer and
      micro-batch, cp - 1 send_recv of this rank's K and V blocks in the forward, and in the
      backward cp - 1 of K, V plus cp - 1 of dK, dV; each 2 x b x (s/cp) x kv_size/tp x bytes.
    Expert parallel (group ep; a mixture-of-experts model):
    - "ep": per MoE layer and micro-batch, an all_to_all dispatching each token to its k
      experts' ranks and one combining the results back in the forward, and the two again for
      their gradients in the backward (4; 6 with recompute="full"). Each is this rank's send
      buffer: its tokens (b x s/cp, / tp with sequence parallelism) x k x capacity_factor
      (None: 1) x h x activation_bytes; a share (ep-1)/ep of it leaves the rank.
    Gradient reduction across dp is not part of "tp", "pp", "cp" or "ep"; add "ddp" or "zero*".
    """
    from labkit.memory import stage_params
    from labkit.models import get_model

    validate.choice("strategy", strategy, STRATEGIES)
    validate.choice("recompute", recompute, RECOMPUTE)
    validate.choice("sp_regather", sp_regather, (False, True))
    if sp_regather and not sequence_parallel:
        raise ValueError("sp_regather=True counts sequence parallelism's backward re-gather; "
                         "it needs sequence_parallel=True")
    dp, tp, pp, cp, m, v = (validate.positive_int(k, x, at_most) for k, x, at_most in
                            (("dp", dp, validate.MAX_RANKS), ("tp", tp, validate.MAX_RANKS),
                             ("pp", pp, validate.MAX_LAYERS), ("cp", cp, validate.MAX_RANKS),
                             ("microbatches", microbatches, validate.MAX_BATCH),
                             ("chunks", chunks, validate.MAX_LAYERS)))
    pb, gb, ab = (validate.positive(k, x, validate.MAX_ELEMENT_BYTES) for k, x in
                  (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                   ("activation_bytes", activation_bytes)))
    spec = None if model is None else get_model(model)
    out = StepComm(strategy)
    add = out.collectives.append

    if strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        if spec is None and num_params is None:
            raise ValueError(f"strategy={strategy!r} needs model= or num_params=")
        if spec is not None:
            _check_model(spec, tp, pp)
            psi = max(stage_params(spec, tp, pp))
        else:
            psi = validate.positive("num_params", num_params, validate.MAX_PARAMS) / (tp * pp)
        if strategy == "ddp":
            add(Collective("all_reduce", 1, psi * gb, dp, "gradients"))
        elif strategy in ("zero1", "zero2"):
            add(Collective("reduce_scatter", 1 if strategy == "zero1" else m, psi * gb, dp,
                           "gradients" + (" (every micro-batch)" if strategy == "zero2" else "")))
            add(Collective("all_gather", 1, psi * pb, dp, "updated weights"))
        elif strategy == "zero3":
            add(Collective("all_gather", m, psi * pb, dp, "weights for the forward"))
            add(Collective("all_gather", m, psi * pb, dp, "weights for the backward"))
            add(Collective("reduce_scatter", m, psi * gb, dp, "gradients"))
        else:
            for size, root in _fsdp_units(spec, psi, units, tp, pp):
                add(Collective("all_gather", m, size * pb, dp, "forward"))
                if reshard_after_forward and not root:
                    add(Collective("all_gather", m, size * pb, dp, "backward"))
                add(Collective("reduce_scatter", m, size * gb, dp, "gradients"))
        return out

    if spec is None:
        raise ValueError(f"strategy={strategy!r} needs model= (a preset name, ModelSpec or "
                         "config): its sizes come from the model's shapes")
    s = validate.positive_int("seq_len", spec.max_seq_len if seq_len is None else seq_len,
                              validate.MAX_SEQ_LEN)
    validate.divides("cp", cp, "seq_len", s)
    _check_model(spec, tp, pp)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    layers = -(-spec.num_layers // pp)           # the busiest stage
    sbh = b * (s // cp) * spec.hidden_size * ab

    if strategy == "tp":
        fwd = 2 * layers * m
        passes = 2 if recompute == "full" else 1
        if sequence_parallel:
            regather = fwd if sp_regather else 0
            add(Collective("all_gather", fwd * passes + fwd + regather, sbh, tp,
                           "g (fwd) / g-bar (bwd)" + (" + input re-gathered (bwd)" if regather
                                                      else "")))
            add(Collective("reduce_scatter", fwd * passes + fwd, sbh, tp, "g-bar (fwd) / g (bwd)"))
        else:
            add(Collective("all_reduce", fwd * passes, sbh, tp, "g: after attention and MLP"))
            add(Collective("all_reduce", fwd, sbh, tp, "f in the backward"))
    elif strategy == "pp":
        if pp > 1:
            sends = _pp_sends_per_rank(pp, v) * m
            size = sbh / tp if (sequence_parallel and tp > 1) else sbh
            add(Collective("send_recv", sends, size, 2, "activations and their gradients"))
    elif strategy == "ep":
        e = validate.positive_int("ep", ep, validate.MAX_RANKS)
        if not spec.is_moe:
            raise ValueError(f"strategy='ep' needs a mixture-of-experts model; {spec.name} is "
                             "dense (num_experts=0)")
        validate.divides("ep", e, "num_experts", spec.num_experts)
        cf = 1.0 if capacity_factor is None else validate.at_least(
            "capacity_factor", capacity_factor, 1e-3, 1e3)
        if e > 1:
            from labkit.placement import stage_expert_params

            per_layer = spec.num_experts * spec.expert_params()
            moe_layers = round(max(stage_expert_params(spec, pp)) / per_layer)
            tokens = b * (s // cp) / (tp if sequence_parallel and tp > 1 else 1)
            size = tokens * spec.experts_per_token * cf * spec.hidden_size * ab
            passes = 6 if recompute == "full" else 4
            add(Collective("all_to_all", passes * moe_layers * m, size, e,
                           "dispatch and combine, forward and backward"))
    elif strategy == "cp":
        if cp > 1:
            kv = 2 * b * (s // cp) * spec.kv_size / tp * ab
            per_layer = (cp - 1) * (3 + (1 if recompute == "full" else 0))
            add(Collective("send_recv", per_layer * layers * m, kv, 2, "K, V and dK, dV blocks"))
    return out


def _check_model(spec, tp, pp):
    from labkit.memory import tp_splits

    for what, count in tp_splits(spec).items():
        validate.divides("tp", tp, what, count)
    if pp > spec.num_layers:
        raise ValueError(f"pp={pp} is larger than num_layers={spec.num_layers}; allowed: 1 to "
                         f"{spec.num_layers}")


def _fsdp_units(spec, psi, units, tp, pp):
    """(parameters, is_root) for each FSDP unit of this rank's replica."""
    if units is not None or spec is None:
        k = validate.positive_int("units", 1 if units is None else units, validate.MAX_LAYERS)
        return [(psi / k, False)] * k
    layer = (spec.layer_parts()["attention_sharded"] + spec.layer_parts()["mlp_sharded"]) / tp \
        + spec.layer_parts()["replicated"]
    n_layers = -(-spec.num_layers // pp)
    return [(layer, False)] * n_layers + [(psi - n_layers * layer, True)]


def _pp_sends_per_rank(pp: int, chunks: int) -> int:
    """Sends per micro-batch of the busiest rank: virtual stage k = rank + j*pp sends forward
    unless it is the last, backward unless it is the first (Narayanan et al. 2021, §2.2)."""
    last = pp * chunks - 1
    return max(sum((k != last) + (k != 0) for k in range(r, last + 1, pp)) for r in range(pp))
