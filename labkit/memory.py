"""Training memory per GPU: model states (ZeRO) and activations (Korthikanti et al. 2022).

    >>> m = estimate_memory("llama2-7b", batch_size=1, seq_len=4096, zero_stage=3, dp=8)
    >>> m.params, m.grads, m.optimizer_states, m.activations, m.total      # bytes per GPU

Model states (Rajbhandari et al. 2020, "ZeRO", §3.1 and Figure 1): mixed-precision Adam keeps
2 bytes of fp16/bf16 weights and 2 bytes of gradients per parameter, plus K = 12 bytes of
optimizer state (4 fp32 master weights, 4 momentum, 4 variance): 16 bytes per parameter. ZeRO
stage 1 partitions the optimizer states over the dp ranks, stage 2 also the gradients, stage 3
also the weights.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4 and Table 2): bytes stored for the backward pass per transformer layer, assuming
16-bit activations and 1-byte dropout masks, for a GPT-style layer (multi-head attention and a 4h
MLP). With precision="fp32" the forward stores fp32 values: `estimate_memory` counts 4 bytes for
each value the paper counts at 2 (the masks stay 1 byte). labkit applies the same formula to
Llama-style layers (grouped-query attention, gated MLP); there it is an approximation, and
`labkit.runtime.measure` reports what a real run holds.

Everything here is pure Python (no torch import); results are bytes per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
import numbers

from labkit import validate
from labkit.hardware import GB, GiB, get_gpu
from labkit.models import ModelSpec, get_model

PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
ZERO_STAGES = (0, 1, 2, 3)


def state_bytes(precision: str = "bf16-mixed", optimizer: str = "adamw") -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter.

    - "fp32": 4-byte weights and gradients; optimizer states in fp32.
    - "fp16-mixed" / "bf16-mixed": 2-byte weights and gradients for the forward and backward,
      and a 4-byte fp32 master copy of the weights counted in the optimizer states (ZeRO §3.1,
      Micikevicius et al. 2018). Optimizer moments in fp32.
    - "bf16": weights, gradients and moments all bf16, no master copy (what `torch.optim` does
      for bf16 parameters: its states are `zeros_like(param)`).

    Optimizer states per parameter: sgd none; sgd-momentum one buffer; adam / adamw two moments
    (exp_avg, exp_avg_sq); adamw-8bit two 1-byte moments (bitsandbytes' block-wise 8-bit Adam,
    Dettmers et al. 2022; the per-block fp32 scales, 4 bytes per 2048 values, are ignored).
    """
    validate.choice("precision", precision, PRECISIONS)
    validate.choice("optimizer", optimizer, OPTIMIZERS)
    weight = 4 if precision == "fp32" else 2
    master = 4 if precision.endswith("-mixed") else 0
    moment = 2 if precision == "bf16" else 4
    moments = {"sgd": 0, "sgd-momentum": moment, "adam": 2 * moment, "adamw": 2 * moment,
               "adamw-8bit": 2}[optimizer]
    return weight, weight, master + moments


def bytes_per_param(precision: str = "bf16-mixed", optimizer: str = "adamw") -> int:
    """Bytes of model states per parameter with no sharding: bf16-mixed + adamw -> 16
    (2 weights + 2 gradients + 12 optimizer: ZeRO's K = 12)."""
    return sum(state_bytes(precision, optimizer))


def activation_bytes_per_layer(seq_len, batch_size, hidden_size, num_heads, tp=1,
                               sequence_parallel=False, recompute="none") -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2).

    With s = seq_len, b = batch_size, h = hidden_size, a = num_heads, t = tp:

    - no recompute, tensor parallel:       s*b*h*(10 + 24/t + 5*a*s/(h*t))
      (t = 1 gives the unparallelised s*b*h*(34 + 5*a*s/h));
    - no recompute, tensor + sequence par.: s*b*h*(34/t + 5*a*s/(h*t));
    - selective recompute (the attention core, softmax and its dropout, is recomputed): the
      5*a*s/(h*t) term goes: s*b*h*(10 + 24/t), or s*b*h*34/t with sequence parallelism;
    - full recompute: only the layer's 16-bit input, 2*s*b*h (Table 2's last row). With
      sequence parallelism that input is itself split along the sequence, so labkit counts
      2*s*b*h/t (Megatron-LM stores it that way; the paper's table does not distinguish).
    """
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    h = validate.positive_int("hidden_size", hidden_size, validate.MAX_WIDTH)
    a = validate.positive_int("num_heads", num_heads, validate.MAX_WIDTH)
    t = validate.divides("tp", tp, "num_heads", a)
    validate.choice("recompute", recompute, RECOMPUTE)
    return _layer_activations(s, b, h, a, t, sequence_parallel, recompute)


def activation_value_bytes(precision: str) -> int:
    """Bytes of one stored activation value under `precision`: 4 for "fp32" (the forward runs
    in fp32), else 2 (fp16/bf16, the Korthikanti et al. setting). Dropout masks stay 1 byte."""
    validate.choice("precision", precision, PRECISIONS)
    return 4 if precision == "fp32" else 2


def _layer_activations(s, b, h, a, t, sp, recompute, value_bytes=2, kv_len=None) -> float:
    """Korthikanti et al. 2022 (§4.1), term by term, for `value_bytes`-byte activations.

    Per layer, in units of s*b*h (value_bytes = 2 gives Table 2 exactly):
    - kept whole by tensor parallelism (split by t only with sequence parallelism): the two
      LayerNorm inputs, the QKV and MLP inputs (4 values), the attention-output and MLP dropout
      masks (2 bytes): 4 * value_bytes + 2 (= 10);
    - split by t: Q, K, V, the output projection's input (4 values), the GELU input and output
      (8 values): 12 * value_bytes (= 24);
    - the attention core, split by t: softmax output and dropout output (2 values) and the
      dropout mask (1 byte) per score, a * s * kv_len scores: (2 * value_bytes + 1) a kv_len / h
      (= 5 a s / h). kv_len: keys each query attends to (the whole sequence, also when context
      parallelism gives this rank only s of the queries).
    - full recompute: the layer's input only, value_bytes * s*b*h (= 2 s*b*h).
    """
    sbh = s * b * h
    kv = s if kv_len is None else kv_len
    if recompute == "full":
        return value_bytes * sbh / (t if sp else 1)
    whole = 4 * value_bytes + 2
    split = 12 * value_bytes
    attn_core = 0.0 if recompute == "selective" else (2 * value_bytes + 1) * a * kv / (h * t)
    rest = (whole + split) / t if sp else whole + split / t
    return sbh * (rest + attn_core)


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

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_states

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
        lines = [f"{'term':<17}{'GB':>10}{'GiB':>10}  what it is"]
        for name, value in rows:
            note = self.explain.get(name, "")
            lines.append(f"{name:<17}{value / GB:>10.2f}{value / GiB:>10.2f}  {note}")
        return "\n".join(lines)


def _stage_layers(num_layers: int, pp: int) -> list[int]:
    # As even as possible; the first L % pp stages take one more layer.
    return [num_layers // pp + (1 if i < num_layers % pp else 0) for i in range(pp)]


def stage_params(spec: ModelSpec, tp: int, pp: int) -> list[float]:
    """Parameters held by one GPU of each pipeline stage (one tensor-parallel rank).

    Weight matrices and column-parallel biases are split over tp; norms and row-parallel biases
    are replicated (Megatron-LM, Shoeybi et al. 2019). The embedding and the LM head are split
    over the vocabulary (vocab-parallel; Megatron pads the vocabulary, ignored here). The first
    stage holds the embeddings, the last the final norm and the head; with tied embeddings and
    pp > 1 the last stage keeps its own copy of the shared matrix (Megatron-LM does this and
    all-reduces the two copies' gradients), with pp = 1 the one tensor serves both.
    """
    parts = spec.layer_parts()
    per_layer = (parts["attention_sharded"] + parts["mlp_sharded"]) / tp + parts["replicated"]
    vh = spec.vocab_size * spec.hidden_size
    embed = vh / tp + (spec.max_seq_len * spec.hidden_size if spec.learned_positions else 0)
    head = vh / tp if (not spec.tied_embeddings or pp > 1) else 0.0
    out = [n * per_layer for n in _stage_layers(spec.num_layers, pp)]
    out[0] += embed
    out[-1] += spec.final_norm_params() + head
    return out


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
                    schedule="1f1b") -> MemoryEstimate:
    """Training memory per GPU, reported for the worst pipeline stage.

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
    """
    validate.choice("precision", precision, PRECISIONS)
    validate.choice("optimizer", optimizer, OPTIMIZERS)
    validate.choice("zero_stage", zero_stage, ZERO_STAGES)
    validate.choice("recompute", recompute, RECOMPUTE)
    validate.choice("schedule", schedule, SCHEDULES)
    dp, tp, cp = (validate.positive_int(n, v, validate.MAX_RANKS) for n, v in
                  (("dp", dp), ("tp", tp), ("cp", cp)))
    pp = validate.positive_int("pp", pp, validate.MAX_LAYERS)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    m = validate.positive_int("microbatches", microbatches, validate.MAX_BATCH)
    w_bytes, g_bytes, o_bytes = state_bytes(precision, optimizer)

    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        n = validate.positive("model (parameter count)", model, validate.MAX_PARAMS)
        per_stage = [n / (tp * pp)] * pp
        spec, s = None, None
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
        per_stage = stage_params(spec, tp, pp)

    shard = {name: (dp if zero_stage >= k else 1)
             for name, k in (("optimizer_states", 1), ("grads", 2), ("params", 3))}
    stages = []
    for i, n in enumerate(per_stage):
        states = {"params": n * w_bytes / shard["params"], "grads": n * g_bytes / shard["grads"],
                  "optimizer_states": n * o_bytes / shard["optimizer_states"]}
        act = 0.0
        if spec is not None:
            act = _stage_activations(spec, i, pp, b, s, cp, tp, sequence_parallel, recompute,
                                     m, schedule, activation_value_bytes(precision))
        stages.append((states, act))
    totals = [sum(st.values()) + act for st, act in stages]
    worst = max(range(pp), key=lambda i: totals[i])
    states, act = stages[worst]

    inputs = dict(model=spec.name if spec else f"{model:,.0f} parameters", batch_size=b, seq_len=s,
                  precision=precision, optimizer=optimizer, zero_stage=zero_stage, dp=dp, tp=tp,
                  pp=pp, cp=cp, sequence_parallel=sequence_parallel, recompute=recompute,
                  microbatches=m, schedule=schedule)
    explain = _explain(per_stage[worst], worst, pp, tp, dp, zero_stage, (w_bytes, g_bytes,
                       o_bytes), precision, optimizer, spec, inputs)
    return MemoryEstimate(params=states["params"], grads=states["grads"],
                          optimizer_states=states["optimizer_states"], activations=act,
                          stage=worst, per_stage=totals, explain=explain, inputs=inputs)


def in_flight(stage: int, pp: int, microbatches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage `stage` holds at its peak: GPipe keeps all m;
    1F1B (PipeDream-Flush) at most pp - stage (Narayanan et al. 2021, §2.2)."""
    validate.choice("schedule", schedule, SCHEDULES)
    return microbatches if schedule == "gpipe" else min(pp - stage, microbatches)


def _stage_activations(spec, i, pp, b, s, cp, tp, sp, recompute, m, schedule,
                       value_bytes=2) -> float:
    """Activation bytes of stage i: its layers x micro-batches in flight, plus the embedding's
    dropout mask on the first stage and the output layer on the last (Korthikanti et al. 2022,
    §4.3: s*b*h/t for the mask; 4*s*b*h/t*(1 + v/h) for the final norm's and head's 16-bit
    inputs and the fp32 logits; the /t for h terms needs sequence parallelism).

    Context parallelism gives this rank s/cp of each sequence's tokens (every s*b*h term
    divides by cp), whose queries still attend to all s keys (the a*s^2*b attention-core term
    divides by cp, not cp^2). With fp32 activations (value_bytes = 4) each stored value
    doubles; the 1-byte dropout masks and the fp32 logits do not change."""
    h, v = spec.hidden_size, spec.vocab_size
    s_local = s // cp
    per_layer = _layer_activations(s_local, b, h, spec.num_heads, tp, sp, recompute,
                                   value_bytes, kv_len=s)
    k = in_flight(i, pp, m, schedule)
    act = _stage_layers(spec.num_layers, pp)[i] * per_layer * k
    split = tp if sp else 1
    if i == 0:
        act += s_local * b * h / split * k
    if i == pp - 1:
        act += (2 * value_bytes * s_local * b * h / split + 4 * s_local * b * v / tp) * k
    return act


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
        width = ("fp32 values (4 B), 1-byte masks" if i["precision"] == "fp32"
                 else "16-bit values, 1-byte masks")
        out["activations"] = (f"Korthikanti et al. 2022, {mode}{sp}, {width}: "
                              f"seq {i['seq_len']}/cp="
                              f"{i['cp']}, micro-batch {i['batch_size']}, "
                              f"{in_flight(worst, pp, i['microbatches'], i['schedule'])} "
                              f"micro-batch(es) in flight ({i['schedule']})")
    out["model_states"] = "params + grads + optimizer_states"
    out["total"] = "model states + activations (no allocator overhead, buffers or CUDA context)"
    return out
