"""Training memory per GPU: model states (ZeRO) and activations (per implementation).

    >>> m = estimate_memory("llama2-7b", batch_size=1, seq_len=4096, zero_stage=3, dp=8)
    >>> m.params, m.grads, m.optimizer_states, m.activations, m.total      # bytes per GPU

Model states: ZeRO (Rajbhandari et al. 2020, §3.1), counted in `labkit.placement`. Activations:
Korthikanti et al. 2022 (§4, Table 2) or what transformers' GPT-2 and Llama keep, term by term
in `labkit.activations`. How the two combine, and every option: `estimate_memory`. Pure Python
(no torch import); results are bytes per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
import numbers

from labkit import activations, validate
from labkit.hardware import GB, GiB, get_gpu
from labkit.models import get_model
# Bytes per parameter, parameters per stage and where the states live come from placement,
# which sits below this module (it must not import memory); re-exported here, where the course
# imports them from.
from labkit.placement import (FP8_PRECISIONS, OFFLOAD, OPTIMIZERS, PRECISIONS, _stage_layers,
                              check_placement, describe_placement, model_states,
                              stage_expert_params, stage_params, state_bytes)
from labkit.precision import GRAD_ACCUM, gradient_bytes

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
ZERO_STAGES = (0, 1, 2, 3)


def bytes_per_param(precision: str = "bf16-mixed", optimizer: str = "adamw",
                    grad_accum: str = "param") -> int:
    """Bytes of model states per parameter with no sharding: bf16-mixed + adamw -> 16
    (2 weights + 2 gradients + 12 optimizer: ZeRO's K = 12); grad_accum="fp32" -> 18
    (Megatron-LM), "both" -> 20 (the Ultra-Scale Playbook)."""
    return sum(state_bytes(precision, optimizer, grad_accum))


def activation_bytes_per_layer(seq_len, batch_size, hidden_size, num_heads, tp=1,
                               sequence_parallel=False, recompute="none", *,
                               implementation="megatron", attention=None, num_kv_heads=None,
                               ffn_size=None, precision="bf16-mixed", dropout=None,
                               device=None, fused_dropout=None) -> float:
    """Activation bytes one transformer layer keeps for backward.

    Called with the shape only, Korthikanti et al. 2022's Table 2 (implementation="megatron",
    its eager attention). With s = seq_len, b = batch_size, h = hidden_size, a = num_heads, t = tp:

    - no recompute, tensor parallel:       s*b*h*(10 + 24/t + 5*a*s/(h*t))
      (t = 1 gives the unparallelised s*b*h*(34 + 5*a*s/h));
    - no recompute, tensor + sequence par.: s*b*h*(34/t + 5*a*s/(h*t));
    - selective recompute (the attention core, softmax and its dropout, is recomputed): the
      5*a*s/(h*t) term goes: s*b*h*(10 + 24/t), or s*b*h*34/t with sequence parallelism;
    - full recompute: only the layer's 16-bit input, 2*s*b*h (Table 2's last row). With
      sequence parallelism that input is itself split along the sequence, so labkit counts
      2*s*b*h/t (Megatron-LM stores it that way; the paper's table does not distinguish).

    implementation "hf-gpt2" / "hf-llama" with attention "eager" / "sdpa" (default "sdpa" for
    them), num_kv_heads (default num_heads), ffn_size (default 4h), precision and dropout count
    what transformers' models keep instead: `labkit.activations` has the terms. device "cuda"
    (default) or "cpu" predicts what that device's kernels keep (on a CPU: dropout masks in
    the activation dtype unless fused_dropout, and SDPA's math path when dropout is on).
    """
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    h = validate.positive_int("hidden_size", hidden_size, validate.MAX_WIDTH)
    a = validate.positive_int("num_heads", num_heads, validate.MAX_WIDTH)
    t = validate.divides("tp", tp, "num_heads", a)
    validate.choice("recompute", recompute, RECOMPUTE)
    kv = a if num_kv_heads is None else validate.divides("num_kv_heads", num_kv_heads,
                                                         "num_heads", a)
    f = 4 * h if ffn_size is None else validate.positive_int("ffn_size", ffn_size,
                                                             validate.MAX_WIDTH)
    return sum(activations.layer_terms(
        implementation, attention, s=s, b=b, h=h, a=a, kv=kv, ffn=f,
        value_bytes=activation_value_bytes(precision), dropout=dropout, tp=t,
        sequence_parallel=sequence_parallel, recompute=recompute, device=device,
        fused_dropout=fused_dropout).values())


def activation_value_bytes(precision: str) -> int:
    """Bytes of one stored activation value under `precision`: 4 for "fp32" (the forward runs
    in fp32), else 2 (fp16/bf16, the Korthikanti et al. setting; "fp8-mixed" is counted as bf16
    too, though FP8 linear layers keep their inputs in 1 byte). Dropout masks stay 1 byte."""
    validate.choice("precision", precision, PRECISIONS + FP8_PRECISIONS)
    return 4 if precision == "fp32" else 2


@dataclass
class MemoryEstimate:
    """Bytes per GPU on the worst pipeline stage. `optimizer_states` includes the fp32 master
    weights of mixed precision. `explain` has one short sentence per term."""

    params: float
    grads: float
    optimizer_states: float
    activations: float
    stage: int = 0                       # index of the worst pipeline stage
    per_stage: list = field(default_factory=list)   # total bytes of every stage
    explain: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)    # this GPU's states in host memory (offload)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_states

    @property
    def host_bytes(self) -> float:
        """Bytes of this GPU's model states that offload keeps in host memory (not in total)."""
        return sum(self.host.values())

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def breakdown(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads,
                "optimizer_states": self.optimizer_states, "activations": self.activations,
                "model_states": self.model_states, "total": self.total}

    def fits(self, gpu) -> bool:
        """Whether `total` fits in a GPU's memory: a key of `labkit.hardware.GPUS` (e.g.
        "h100-sxm"), a GPU object, or a number of bytes."""
        if isinstance(gpu, numbers.Real) and not isinstance(gpu, bool):
            return self.total <= validate.positive("gpu", gpu, validate.MAX_BYTES)
        return self.total <= get_gpu(gpu).memory

    def table(self) -> str:
        """A readable per-GPU table in GB (1e9 bytes) and GiB (2**30 bytes)."""
        rows = [("params", self.params), ("grads", self.grads),
                ("optimizer_states", self.optimizer_states), ("activations", self.activations),
                ("total", self.total)]
        if self.host_bytes:
            rows.append(("host (offload)", self.host_bytes))
        lines = [f"{'term':<17}{'GB':>10}{'GiB':>10}  what it is"]
        for name, value in rows:
            note = self.explain.get(name, "")
            lines.append(f"{name:<17}{value / GB:>10.2f}{value / GiB:>10.2f}  {note}")
        return "\n".join(lines)


def tp_splits(model) -> dict[str, int]:
    """What tensor parallelism splits evenly over the tp ranks of `model` (a preset name, a
    ModelSpec or a config): each rank takes whole attention heads, whole KV heads and an equal
    slice of the MLP (Megatron-LM), so tp must divide each of these counts."""
    spec = get_model(model)
    return {"num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
            "ffn_size": spec.ffn_size}


def tp_degrees(model) -> list[int]:
    """The tensor-parallel degrees `estimate_memory` accepts for `model`: the divisors of every
    count in `tp_splits(model)` (llama2-7b: 1, 2, 4, 8, 16, 32; gpt2: 1, 2, 3, 4, 6, 12)."""
    return validate.divisors(math.gcd(*tp_splits(model).values()))


def estimate_memory(model, batch_size=1, seq_len=None, precision="bf16-mixed",
                    optimizer="adamw", zero_stage=0, dp=1, tp=1, pp=1, cp=1,
                    sequence_parallel=False, recompute="none", microbatches=1,
                    schedule="1f1b", implementation=None, attention=None,
                    dropout=None, grad_accum="param", offload="none",
                    largest_layer=None, device=None, fused_dropout=None,
                    uneven=False, ep=1, etp=1, capacity_factor=None) -> MemoryEstimate:
    """Training memory per GPU, reported for the worst pipeline stage.

    Model states (Rajbhandari et al. 2020, "ZeRO", §3.1 and Figure 1): mixed-precision Adam
    keeps 2 bytes of fp16/bf16 weights and 2 bytes of gradients per parameter, plus K = 12 bytes
    of optimizer state (4 fp32 master weights, 4 momentum, 4 variance): 16 bytes per parameter
    (`state_bytes`). ZeRO stage 1 partitions the optimizer states over the dp ranks, stage 2
    also the gradients, stage 3 also the weights (`labkit.placement.model_states`). What other
    stacks keep is an option: fp32 gradients (`grad_accum`: Megatron-LM's 18 B/param,
    DeepSpeed's and the Ultra-Scale Playbook's 20), CPU offload (`offload`, host bytes in
    `.host`), ZeRO-3's gathered unit (`largest_layer`), FP8 matmuls (precision="fp8-mixed"):
    see `labkit.precision` and `labkit.placement`.

    Activations: bytes stored for the backward pass per transformer layer, term by term for the
    implementation that runs the model (`labkit.activations`, each checked against
    saved-tensor hooks on real models): implementation="megatron" is Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", §4 and Table 2: a GPT
    layer, 16-bit activations, 1-byte dropout masks); "hf-gpt2" and "hf-llama" are
    transformers' GPT-2 and Llama (the defaults for those models, with SDPA attention, which
    keeps no s x s scores). With precision="fp32" the forward stores fp32 values: 4 bytes for
    each value counted at 2 (the masks stay 1 byte).

    model: a preset name, a ModelSpec, a transformers config, or a plain parameter count (then
        model states only, split evenly over tp * pp, and no activations).
    batch_size: the micro-batch size, in sequences. seq_len: tokens per sequence (default: the
        model's context length). microbatches: micro-batches per step (m).
    zero_stage: 0 replicates everything over dp; 1 shards optimizer states; 2 also gradients;
        3 also weights (Rajbhandari et al. 2020, §5).
    pp: layers split over stages; in flight on stage i: m for "gpipe", min(pp - i, m) for
        "1f1b" (Narayanan et al. 2021, §2.2), so the first stage holds the most.
    cp: context parallelism splits each sequence over cp ranks (activations divide by cp: each
        rank keeps s/cp tokens, whose queries attend to all s keys).
    implementation: whose activations ("megatron": Korthikanti et al.'s Table 2; "hf-gpt2",
        "hf-llama": what transformers' models keep); default from the model (GPT-2 ->
        "hf-gpt2", Llama-style -> "hf-llama"). attention: "eager" (scores kept) or "sdpa"
        (fused, no scores); default "sdpa" for transformers, "eager" for Megatron (the paper's).
        dropout: default on for Megatron and GPT-2, off for Llama. `labkit.activations`.
    device: whose kernels keep the activations, "cuda" (default: what a GPU run keeps) or "cpu"
        (what a learner's CPU measures: torch's CPU dropout keeps its mask in the activation
        dtype, and SDPA with dropout falls back to its math path, fp32 scores). fused_dropout:
        F.dropout is the 1-byte-mask fused kernel (default: True on CUDA, False on a CPU).
    grad_accum: "param" (ZeRO's 16 B/param), "fp32" (Megatron's main_grad, 18) or "both"
        (16-bit + fp32 gradients, 20): `labkit.precision.gradient_bytes`.
    offload: "none", "optimizer" (ZeRO-Offload) or "params" (ZeRO-3 / FSDP2 CPU offload); the
        states kept on the host are in `.host`, not in `.total`. largest_layer: parameters of
        the unit ZeRO-3 gathers at once (weights + gradient counted); `labkit.placement`.
    uneven: the first and last pipeline stages hold one transformer layer fewer, the embedding
        and the output layer taking their slots (Llama 3; `labkit.placement.stage_layers`).
    ep / etp (a mixture of experts): each MoE layer's routed experts split over ep x etp ranks
        (expert and expert-tensor parallelism), folded into the tp x dp ranks as Megatron-LM
        does, so their states shard (ZeRO) over the expert-data-parallel group
        edp = tp x dp / (ep x etp); the dense states over dp as before. capacity_factor: each
        expert's buffer holds capacity_factor x its share of the k x tokens assignments (None:
        no capacity, exactly k x tokens). An MoE layer's activations: the MLP terms at
        k x capacity x the expert width (+ shared experts), the router's fp32 probabilities
        and the dispatched and combined token copies (`moe_extra_bytes`).
    """
    validate.choice("precision", precision, PRECISIONS + FP8_PRECISIONS)
    validate.choice("optimizer", optimizer, OPTIMIZERS)
    validate.choice("zero_stage", zero_stage, ZERO_STAGES)
    gathered = check_placement(zero_stage, offload, largest_layer)
    validate.choice("recompute", recompute, RECOMPUTE)
    validate.choice("schedule", schedule, SCHEDULES)
    dp, tp, cp = (validate.positive_int(n, v, validate.MAX_RANKS) for n, v in
                  (("dp", dp), ("tp", tp), ("cp", cp)))
    pp = validate.positive_int("pp", pp, validate.MAX_LAYERS)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    m = validate.positive_int("microbatches", microbatches, validate.MAX_BATCH)
    w_bytes, g_bytes, o_bytes = state_bytes(precision, optimizer, grad_accum)
    grads = gradient_bytes(w_bytes, grad_accum)

    ep = validate.positive_int("ep", ep, validate.MAX_RANKS)
    etp = validate.positive_int("etp", etp, validate.MAX_RANKS)
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        n = validate.positive("model (parameter count)", model, validate.MAX_PARAMS)
        per_stage = [n / (tp * pp)] * pp
        experts = [0.0] * pp
        spec, s = None, None
        if ep * etp > 1:
            raise ValueError("ep / etp need a mixture-of-experts model (a ModelSpec with "
                             "num_experts); a parameter count has no experts; allowed: ep=1")
    else:
        spec = get_model(model)
        for what, count in tp_splits(spec).items():
            validate.divides("tp", tp, what, count)
        if pp > spec.num_layers:
            raise ValueError(f"pp={pp} is larger than num_layers={spec.num_layers}; allowed: "
                             f"1 to {spec.num_layers}")
        s = validate.positive_int("seq_len", spec.max_seq_len if seq_len is None else seq_len,
                                  validate.MAX_SEQ_LEN)
        if spec.learned_positions and s > spec.max_seq_len:
            raise ValueError(f"seq_len={s} exceeds the {spec.max_seq_len} learned positions of "
                             f"{spec.name}; allowed: 1 to {spec.max_seq_len}")
        validate.divides("cp", cp, "seq_len", s)
        if sequence_parallel and tp > 1:
            validate.divides("tp", tp, "seq_len / cp", s // cp)
        edp = _expert_group(spec, ep, etp, tp, dp, capacity_factor)
        per_stage = stage_params(spec, tp, pp, uneven, experts=False)
        experts = stage_expert_params(spec, pp, ep, etp, uneven)
    implementation, attention, dropout = activations.resolve(implementation, attention, dropout,
                                                             spec, device)
    kernels = dict(device=device, fused_dropout=fused_dropout)
    mask = activations.mask_bytes(device, fused_dropout, activation_value_bytes(precision))

    stages = []
    for i, (n, n_exp) in enumerate(zip(per_stage, experts)):
        states, host = model_states(n, w_bytes, grads, o_bytes, zero_stage, dp, offload, gathered)
        if n_exp:
            more, more_host = model_states(n_exp, w_bytes, grads, o_bytes, zero_stage, edp,
                                           offload)
            states = {k: v + more[k] for k, v in states.items()}
            host = {k: v + more_host[k] for k, v in host.items()}
        act = 0.0
        if spec is not None:
            act = _stage_activations(spec, i, pp, b, s, cp, tp, sequence_parallel, recompute,
                                     m, schedule, activation_value_bytes(precision),
                                     (implementation, attention, dropout), kernels, uneven,
                                     capacity_factor)
        stages.append((states, act, host))
    totals = [sum(st.values()) + act for st, act, _ in stages]
    worst = max(range(pp), key=lambda i: totals[i])
    states, act, host = stages[worst]

    inputs = dict(model=spec.name if spec else f"{model:,.0f} parameters", batch_size=b, seq_len=s,
                  precision=precision, optimizer=optimizer, zero_stage=zero_stage, dp=dp, tp=tp,
                  pp=pp, cp=cp, sequence_parallel=sequence_parallel, recompute=recompute,
                  microbatches=m, schedule=schedule, implementation=implementation,
                  attention=attention, dropout=dropout, grad_accum=grad_accum, offload=offload,
                  largest_layer=largest_layer, device=device or "cuda", mask_bytes=mask,
                  uneven=bool(uneven), ep=ep, etp=etp, capacity_factor=capacity_factor)
    explain = _explain(per_stage[worst] + experts[worst], worst, pp, tp, dp, zero_stage, (w_bytes, g_bytes,
                       o_bytes), precision, optimizer, spec, inputs)
    explain.update(describe_placement(explain, grad_accum, offload, gathered, host))
    return MemoryEstimate(params=states["params"], grads=states["grads"],
                          optimizer_states=states["optimizer_states"], activations=act,
                          stage=worst, per_stage=totals, explain=explain, inputs=inputs,
                          host=host)


def in_flight(stage: int, pp: int, microbatches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage `stage` holds at its peak: GPipe keeps all m;
    1F1B (PipeDream-Flush) at most pp - stage (Narayanan et al. 2021, §2.2)."""
    validate.choice("schedule", schedule, SCHEDULES)
    return microbatches if schedule == "gpipe" else min(pp - stage, microbatches)


def _stage_activations(spec, i, pp, b, s, cp, tp, sp, recompute, m, schedule,
                       value_bytes=2, impl=("megatron", "eager", True), kernels=None,
                       uneven=False, capacity_factor=None) -> float:
    """Activation bytes of stage i: its layers x micro-batches in flight, plus what lies outside
    the layers (`labkit.activations.stage_extra_terms`: the embedding's dropout mask on the
    first stage, the final norm and the fp32 logits on the last; Korthikanti et al. 2022, §4.3).
    `impl`: (implementation, attention, dropout); `kernels`: device and fused_dropout.

    Context parallelism gives this rank s/cp of each sequence's tokens (every s*b*h term
    divides by cp), whose queries still attend to all s keys (the a*s^2*b attention-core term
    divides by cp, not cp^2). With fp32 activations (value_bytes = 4) each stored value
    doubles; the 1-byte dropout masks (CUDA's) and the fp32 logits do not change."""
    implementation, attention, dropout = impl
    s_local = s // cp
    shape = dict(s=s_local, b=b, h=spec.hidden_size, value_bytes=value_bytes, dropout=dropout,
                 tp=tp, sequence_parallel=sp, **(kernels or {}))
    def per_layer(ffn, extra=0.0):
        return sum(activations.layer_terms(
            implementation, attention, a=spec.num_heads, kv=spec.num_kv_heads, q=spec.q_size,
            ffn=ffn, recompute=recompute, kv_len=s, **shape).values()) + extra

    k = in_flight(i, pp, m, schedule)
    counts = _stage_layers(spec.num_layers, pp, uneven)
    n = counts[i]
    if spec.is_moe:
        first = sum(counts[:i])
        dense = max(0, min(n, spec.dense_layers - first))
        width = spec.expert_ffn * (spec.experts_per_token * (capacity_factor or 1.0)
                                   + spec.shared_experts)
        extra = (0.0 if recompute == "full" else
                 moe_extra_bytes(spec, s_local * b, value_bytes, capacity_factor)
                 / (tp if sp else 1))
        act = dense * per_layer(spec.ffn_size) + (n - dense) * per_layer(width, extra)
    else:
        act = n * per_layer(spec.ffn_size)
    act += sum(activations.stage_extra_terms(implementation, i == 0, i == pp - 1,
                                             vocab=spec.vocab_size, **shape).values())
    return act * k


def moe_extra_bytes(spec, tokens, value_bytes=2, capacity_factor=None) -> float:
    """Bytes an MoE layer keeps beyond its experts' MLP terms, for `tokens` tokens: the router's
    fp32 probabilities (tokens x num_experts x 4), and the k x capacity copies of each token
    sent to its experts (dispatched, the experts' input) and sent back (combined, kept for the
    gradient of the routing weights): 2 x k x capacity x hidden values per token, less the one
    MLP input the dense terms already count."""
    copies = spec.experts_per_token * (capacity_factor or 1.0)
    return tokens * (4 * spec.num_experts + (2 * copies - 1) * spec.hidden_size * value_bytes)


def _expert_group(spec, ep, etp, tp, dp, capacity_factor) -> int:
    """edp, the group an MoE model's expert states shard over; checks ep, etp and the
    capacity factor."""
    if capacity_factor is not None:
        validate.at_least("capacity_factor", capacity_factor, 1e-3, 1e3)
    if not spec.is_moe:
        if ep * etp > 1 or capacity_factor is not None:
            raise ValueError(f"ep={ep}, etp={etp}, capacity_factor={capacity_factor!r} need a "
                             f"mixture-of-experts model; {spec.name} is dense; allowed: ep=1, "
                             "etp=1, capacity_factor=None")
        return 1
    validate.divides("ep", ep, "num_experts", spec.num_experts)
    if (tp * dp) % (ep * etp):
        raise ValueError(f"ep x etp = {ep} x {etp} must divide tp x dp = {tp} x {dp} (the "
                         "expert layers reuse the dense layers' ranks); allowed: ep x etp a "
                         f"divisor of {tp * dp}")
    validate.divides("etp", etp, "expert_ffn_size", spec.expert_ffn)
    return tp * dp // (ep * etp)


def _explain(n, worst, pp, tp, dp, zero_stage, bytes_, precision, optimizer, spec, inputs):
    w, g, o = bytes_
    where = f"stage {worst} of {pp}, " if pp > 1 else ""
    held = f"{n:,.0f} parameters on this GPU ({where}tp={tp})"

    def sharded(k):
        return f", / dp={dp} (ZeRO-{zero_stage})" if zero_stage >= k and dp > 1 else ""

    master = " incl. 4 B fp32 master weights" if precision.endswith("-mixed") else ""
    out = {
        "params": f"{w} B/param ({precision}) x {held}{sharded(3)}",
        "grads": f"{g} B/param x {held}{sharded(2)}",
        "optimizer_states": f"{o} B/param ({optimizer}{master}) x {held}{sharded(1)}",
    }
    if spec is None:
        out["activations"] = "not counted: a plain parameter count has no shapes"
    else:
        i = inputs
        mode = {"none": "no recompute", "selective": "selective recompute",
                "full": "full recompute"}[i["recompute"]]
        sp = ", sequence parallel" if i["sequence_parallel"] else ""
        width = ("fp32 values (4 B)" if i["precision"] == "fp32" else "16-bit values") + \
            (f", {i['mask_bytes']}-byte masks" if i["dropout"] else "")
        what = activations.describe(i["implementation"], i["attention"], i["dropout"],
                                    i["device"])
        out["activations"] = (f"{what}, {mode}{sp}, {width}: "
                              f"seq {i['seq_len']}/cp="
                              f"{i['cp']}, micro-batch {i['batch_size']}, "
                              f"{in_flight(worst, pp, i['microbatches'], i['schedule'])} "
                              f"micro-batch(es) in flight ({i['schedule']})")
    out["model_states"] = "params + grads + optimizer_states"
    out["total"] = "model states + activations (no allocator overhead, buffers or CUDA context)"
    return out
