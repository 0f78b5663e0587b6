"""FSDP2 (`torch.distributed.fsdp.fully_shard`) priced per rank: units, memory and collectives.

    >>> unit_params("debug-llama")                 # per FSDP unit: each block, then the root
    >>> m = fsdp_memory("llama2-7b", dp=8, param_dtype="bf16")
    >>> m.params, m.unsharded_peak, m.total; print(m.table())
    >>> fsdp_communication("llama2-7b", dp=8, reshard_after_forward=4).by_op

The units are `labkit.parallel.fsdp.shard_model`'s; the bytes are read from torch 2.13's
torch/distributed/fsdp/_fully_shard. What is exact, what is not modelled and why: `fsdp_memory`.
Activations are `labkit.memory.estimate_memory`'s; FSDP1 -> FSDP2 is `labkit.fsdp_migrate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math

from labkit import validate
from labkit.comm import StepComm, step_communication
from labkit.hardware import GB, GiB
from labkit.models import ModelSpec, get_model

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MASTER_BYTES = 4                 # the model is built in fp32: shards, gradients, master copy
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}
STEP_BYTES = {"adamw": 4, "adam": 4, "sgd-momentum": 0, "sgd": 0}


# ---- the parameter tensors of each unit -------------------------------------------------------

def block_shapes(spec: ModelSpec, dense: bool = False) -> list[tuple[str, tuple]]:
    """(name, shape) of one transformer block's parameters as transformers builds them:
    nn.Linear weights are (out, in) for Llama-style models; GPT-2's Conv1D are (in, out). A
    mixture of experts (transformers 5): the router `mlp.gate.weight` (E, h) and the experts as
    two stacked tensors, `mlp.experts.gate_up_proj` (E, 2 f, h) and `down_proj` (E, h, f);
    dense=True: one of its first `dense_layers` blocks."""
    if spec.is_moe:
        return _moe_block_shapes(spec, dense)
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_size
    norm = [("weight", (h,))] + ([("bias", (h,))] if spec.norm == "layernorm" else [])
    out: list[tuple[str, tuple]] = []
    if spec.arch == "gpt2":
        out += [("attn.c_attn.weight", (h, q + 2 * kv)), ("attn.c_attn.bias", (q + 2 * kv,)),
                ("attn.c_proj.weight", (q, h)), ("attn.c_proj.bias", (h,)),
                ("mlp.c_fc.weight", (h, f)), ("mlp.c_fc.bias", (f,)),
                ("mlp.c_proj.weight", (f, h)), ("mlp.c_proj.bias", (h,))]
        return out + [(f"ln_{i}.{n}", s) for i in (1, 2) for n, s in norm]
    for name, rows in (("q", q), ("k", kv), ("v", kv)):
        out.append((f"self_attn.{name}_proj.weight", (rows, h)))
        if spec.qkv_bias:
            out.append((f"self_attn.{name}_proj.bias", (rows,)))
    out.append(("self_attn.o_proj.weight", (h, q)))
    if spec.out_bias:
        out.append(("self_attn.o_proj.bias", (h,)))
    for name, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
        out.append((f"mlp.{name}_proj.weight", shape))
        if spec.mlp_bias:
            out.append((f"mlp.{name}_proj.bias", (shape[0],)))
    return out + [(f"{n}_layernorm.{k}", s) for n in ("input", "post_attention") for k, s in norm]


def _moe_block_shapes(spec: ModelSpec, dense: bool) -> list[tuple[str, tuple]]:
    h, a, E, fe = spec.hidden_size, spec.num_heads, spec.num_experts, spec.expert_ffn
    if spec.mla:
        q_lora, kv_lora, nope, rope, v = spec.mla
        out = ([("self_attn.q_a_proj.weight", (q_lora, h)),
                ("self_attn.q_a_layernorm.weight", (q_lora,)),
                ("self_attn.q_b_proj.weight", (a * (nope + rope), q_lora))] if q_lora else
               [("self_attn.q_proj.weight", (a * (nope + rope), h))])
        out += [("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
                ("self_attn.kv_a_layernorm.weight", (kv_lora,)),
                ("self_attn.kv_b_proj.weight", (a * (nope + v), kv_lora)),
                ("self_attn.o_proj.weight", (h, a * v))]
    else:
        q, kv = spec.q_size, spec.kv_size
        out = [("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
               ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q))]
        if spec.qk_norm:
            out += [("self_attn.q_norm.weight", (spec.d_head,)),
                    ("self_attn.k_norm.weight", (spec.d_head,))]
    if dense:
        f = spec.ffn_size
        out += [("mlp.gate_proj.weight", (f, h)), ("mlp.up_proj.weight", (f, h)),
                ("mlp.down_proj.weight", (h, f))]
    else:
        out += [("mlp.gate.weight", (E, h)), ("mlp.experts.gate_up_proj", (E, 2 * fe, h)),
                ("mlp.experts.down_proj", (E, h, fe))]
        if spec.shared_experts:
            fs = fe * spec.shared_experts
            out += [("mlp.shared_experts.gate_proj.weight", (fs, h)),
                    ("mlp.shared_experts.up_proj.weight", (fs, h)),
                    ("mlp.shared_experts.down_proj.weight", (h, fs))]
    return out + [(f"{n}_layernorm.weight", (h,)) for n in ("input", "post_attention")]


def root_shapes(spec: ModelSpec) -> list[tuple[str, tuple]]:
    """(name, shape) of what the root unit holds: token (and position) embeddings, the final
    norm, and the LM head unless it is tied to the token embedding (one tensor, counted once)."""
    h, v = spec.hidden_size, spec.vocab_size
    out = [("embed_tokens.weight", (v, h))]
    if spec.learned_positions:
        out.append(("embed_positions.weight", (spec.max_seq_len, h)))
    out += [("norm.weight", (h,))] + ([("norm.bias", (h,))] if spec.norm == "layernorm" else [])
    return out + ([] if spec.tied_embeddings else [("lm_head.weight", (v, h))])


def unit_shapes(model, per_block: bool = True) -> list[list[tuple]]:
    """The parameter shapes of each FSDP unit in `shard_model`'s order: one list per block, the
    root last; per_block=False: one unit with everything."""
    spec = get_model(model)
    validate.choice("per_block", per_block, (True, False))
    blocks = [[s for _, s in block_shapes(spec, dense=i < spec.dense_layers)]
              for i in range(spec.num_layers)]
    root = [s for _, s in root_shapes(spec)]
    return blocks + [root] if per_block else [sum(blocks, []) + root]


def unit_params(model, per_block: bool = True) -> list[int]:
    """Parameters per FSDP unit of `model` (a preset name, ModelSpec or transformers config), in
    `labkit.parallel.fsdp.shard_model`'s order: one per transformer block, the root last
    (embeddings, final norm, head, positions); per_block=False: [all of them]."""
    return [sum(math.prod(s) for s in unit) for unit in unit_shapes(model, per_block)]


def padded_shard(shape: tuple, dp: int) -> int:
    """Elements of rank 0's shard of one parameter on `dp` ranks, as FSDP2 stores it on every
    rank: ceil(dim0 / dp) rows (torch.chunk), the rest of the shape whole."""
    dp = validate.positive_int("dp", dp, validate.MAX_RANKS)
    return -(-shape[0] // dp) * math.prod(shape[1:])


def unit_shards(model, dp: int, per_block: bool = True) -> list[int]:
    """Elements of each unit's padded shard on one rank (the all-gather input)."""
    return [sum(padded_shard(s, dp) for s in unit) for unit in unit_shapes(model, per_block)]


# ---- validation shared by memory and communication --------------------------------------------

def _dtype_bytes(name: str, value, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if value not in DTYPE_BYTES:
        allowed = ", ".join(repr(k) for k in DTYPE_BYTES) + (", None (= param_dtype)"
                                                              if default is not None else "")
        raise ValueError(f"{name}={validate.describe(value)} is not supported; allowed: "
                         f"{allowed}")
    return DTYPE_BYTES[value]


def _reshard(value, dp: int):
    """True, False or an int k, 2 <= k < dp dividing dp (k = dp is True); FSDP2: "a non-trivial
    divisor of the mesh shard dim size (i.e. excluding 1 and the dim size itself)"."""
    if isinstance(value, bool):
        return value
    allowed = [d for d in validate.divisors(dp) if 1 < d <= dp]
    if isinstance(value, int) and value in allowed:
        return True if value == dp else value
    raise ValueError(f"reshard_after_forward={validate.describe(value)} is not supported at "
                     f"dp={dp}; allowed: True, False or an int that divides dp and is at least 2"
                     f" ({', '.join(map(str, allowed)) or 'none at dp=1'})")


def _checked(model, dp, per_block, reshard_after_forward, param_dtype, reduce_dtype):
    spec = get_model(model)
    dp = validate.positive_int("dp", dp, validate.MAX_RANKS)
    validate.choice("per_block", per_block, (True, False))
    rs = _reshard(reshard_after_forward, dp)
    pb = _dtype_bytes("param_dtype", param_dtype)
    return spec, dp, rs, pb, _dtype_bytes("reduce_dtype", reduce_dtype, pb)


# ---- communication ----------------------------------------------------------------------------

def fsdp_communication(model, dp, *, per_block=True, reshard_after_forward=True,
                       param_dtype="fp32", reduce_dtype=None) -> StepComm:
    """FSDP2's collectives in one step on one rank (`labkit.comm.step_communication("fsdp")`):
    per unit an all-gather for the forward, another for the backward (not for the root, which
    keeps its weights; not with reshard_after_forward=False), and a reduce-scatter of the
    gradients. Payloads are FSDP2's padded ones (N x the padded shard) in param_dtype for the
    all-gathers and reduce_dtype (default param_dtype) for the reduce-scatter. An int k reshards
    to k ranks after the forward, so the backward all-gathers run over k ranks."""
    spec, dp, rs, pb, rb = _checked(model, dp, per_block, reshard_after_forward, param_dtype,
                                    reduce_dtype)
    out = step_communication("fsdp", model=spec, dp=dp, units=None if per_block else 1,
                             reshard_after_forward=bool(rs), param_bytes=pb, grad_bytes=rb)
    sizes = [dp * s for s in unit_shards(spec, dp, per_block)]
    unit = -1
    for c in out.collectives:                      # unit by unit, each opened by its forward
        unit += c.why == "forward"
        c.nbytes = sizes[unit] * (rb if c.op == "reduce_scatter" else pb)
        if c.why == "backward" and rs is not True:
            c.group = rs
            c.why = f"backward, within {rs} ranks"
    if unit != len(sizes) - 1:
        raise AssertionError(f"{len(sizes)} units but {unit + 1} forward all-gathers")
    return out


# ---- memory -----------------------------------------------------------------------------------

@dataclass
class FSDPMemory:
    """Bytes on one rank (the busiest, rank 0) of an FSDP2 model; `explain` says each term."""

    params: float             # sharded fp32 parameters (the master copy)
    grads: float              # sharded fp32 gradients
    optimizer_states: float   # optimizer moments of the local shard
    unsharded_held: float     # unsharded parameters (+ post-forward shards) between the passes
    unsharded_peak: float     # the most unsharded parameters (+ post-forward shards) at once
    steps: float = 0.0        # AdamW's 4-byte step tensors (CPU; not in total)
    host: float = 0.0         # under offload: params + grads + optimizer states on the host
    explain: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer_states

    @property
    def total(self) -> float:
        """Sharded states (0 under offload) + the unsharded-parameter peak: a lower bound of the
        device bytes at the step's peak (activations, unsharded gradients and the collectives'
        flat buffers are not counted: see `fsdp_memory`)."""
        return self.model_states + self.unsharded_peak

    def table(self) -> str:
        """One line per term in GB (1e9) and GiB (2**30) with what it is."""
        rows = [("params", self.params), ("grads", self.grads),
                ("optimizer_states", self.optimizer_states),
                ("unsharded_held", self.unsharded_held),
                ("unsharded_peak", self.unsharded_peak), ("total", self.total)]
        rows += [("steps", self.steps)] if self.steps else []
        rows += [("host (offload)", self.host)] if self.host else []
        lines = [f"{'term':<18}{'GB':>10}{'GiB':>10}  what it is"]
        for name, value in rows:
            note = self.explain.get(name.split()[0], "")
            lines.append(f"{name:<18}{value / GB:>10.3f}{value / GiB:>10.3f}  {note}")
        return "\n".join(lines)


def unsharded_bytes(unit_bytes: list, per_block: bool, reshard_after_forward) -> tuple:
    """(held between the passes, peak) of unsharded parameters and post-forward shards, from
    each unit's unsharded bytes (blocks, then the root) and reshard_after_forward (True, False
    or an int k). The root (per_block) stays gathered from its forward to the end of the
    backward; a unit is gathered from its copy-out to its reshard: True frees it, False keeps it
    whole, an int k keeps a 1/k post-forward shard, allocated while the unit is still whole, so
    unit i's reshard is the moment of the peak: what units 0..i-1 keep, plus unit i, plus its
    post-forward shard. The copy-out into the unsharded parameters waits for compute to need the
    unit, so prefetching (which only issues the all-gather earlier) holds no more of them."""
    rs = reshard_after_forward
    blocks, root = (unit_bytes[:-1], unit_bytes[-1]) if per_block else (unit_bytes, 0)
    post = [0 if isinstance(rs, bool) else b // rs for b in blocks]
    kept = [b if rs is False else p for b, p in zip(blocks, post)]
    peak = max((sum(kept[:i]) + b + post[i] for i, b in enumerate(blocks)), default=0)
    return root + sum(kept), root + peak


def fsdp_memory(model, dp, *, per_block=True, reshard_after_forward=True, param_dtype="fp32",
                reduce_dtype=None, prefetch=0, optimizer="adamw", offload=False) -> FSDPMemory:
    """Per-rank bytes of `model` under FSDP2 on `dp` ranks (what is exact: below).

    per_block, reshard_after_forward (True, False or an int k), param_dtype / reduce_dtype
    ("fp32", "bf16", "fp16"; reduce None = param_dtype), prefetch (units gathered ahead, 0 =
    FSDP2's implicit prefetching), optimizer ("adamw", "adam", "sgd-momentum", "sgd"), offload
    (CPUOffloadPolicy: sharded params, grads and the optimizer on the host, in `.host`).

    The units are `fully_shard` on every transformer block, then on the root (embeddings, final
    norm, LM head, learned positions). What FSDP2 allocates (torch 2.13,
    torch/distributed/fsdp/_fully_shard: _fsdp_param.py, _fsdp_collectives.py,
    _fsdp_param_group.py), for the busiest rank (rank 0) of N:
    - each parameter is split on dim 0 with torch.chunk: rank 0 keeps ceil(d0 / N) rows, and
      the shard is stored padded to that size on every rank (`padded_sharded_param_size`), so
      a dimension that N does not divide costs padding (FSDP2 "pads dim 0 to a multiple of N");
    - the sharded parameters stay in the model's dtype (fp32 here: the master copy), the
      sharded gradients too (the reduce-scatter output is cast back to it), AdamW's two moments
      are `zeros_like` the local shard (8 bytes per element), and AdamW keeps one 4-byte `step`
      tensor per parameter tensor (`steps`, apart: on the CPU for the non-fused optimizer);
    - each parameter's all-gather output (`FSDPParam.all_gather_outputs`, the storage of the
      unsharded parameter) is N x its padded shard in `param_dtype`; reshard_after_forward=k
      keeps the 1/k slice of it after the forward (`_sharded_post_forward_param_data`).

    Exact (equal to FSDP2's storage bytes): params, grads, optimizer_states, steps, host,
    unsharded_held and unsharded_peak (`unsharded_bytes`); labkit.labs.fsdp --part options
    measures all but steps at ratio 1.000 for every option, on Llama and GPT-2.

    Not modelled, on purpose: the flat all-gather output of each unit (N x its shards, copied
    out into the parameters), the unsharded gradients and the reduce-scatter input (N x the
    shard in `reduce_dtype`). Their lifetimes are set by local references inside FSDP2
    (`wait_for_unshard` keeps the previous forward all-gather in a local until it returns;
    `comm_ctx.all_gather_state` keeps the last forward one until the next copy-out or the
    root's post-forward; `comm_ctx.reduce_scatter_states` keeps one reduce-scatter input until
    the next unit's post-backward), by autograd's order of gradient accumulation inside a block
    (the root's head gradient lives through the whole backward, its embedding gradient only at
    the end) and, on a GPU, by stream-ordered freeing; a sum of them was checked against a
    measurement and was off (4-rank Llama 1.459, GPT-2 0.863), so it is not given. `total` is
    therefore a lower bound of the step's peak; the lab reports torch's FSDPMemTracker peak by
    category beside it."""
    spec, dp, rs, pb, _ = _checked(model, dp, per_block, reshard_after_forward, param_dtype,
                                   reduce_dtype)
    validate.choice("optimizer", optimizer, OPTIMIZERS)
    validate.choice("offload", offload, (True, False))
    if not (isinstance(prefetch, int) and not isinstance(prefetch, bool) and
            0 <= prefetch <= validate.MAX_LAYERS):
        raise ValueError(f"prefetch={validate.describe(prefetch)} must be a whole number >= 0 "
                         f"and <= {validate.show(validate.MAX_LAYERS)} (units gathered ahead)")
    shapes = unit_shapes(spec, per_block)
    shards = [sum(padded_shard(s, dp) for s in u) for u in shapes]
    numels = [sum(math.prod(s) for s in u) for u in shapes]
    # each parameter's all-gather output (the unsharded parameter's storage) is N x its padded
    # shard; an int k keeps the 1/k slice of it (`_sharded_post_forward_param_data`)
    unit_bytes = [dp * s * pb for s in shards]
    held, peak = unsharded_bytes(unit_bytes, per_block, rs)
    shard = sum(shards)
    states = [MASTER_BYTES * shard, MASTER_BYTES * shard, OPTIMIZER_BYTES[optimizer] * shard]
    tensors = sum(len(u) for u in shapes)
    host = sum(states) if offload else 0.0
    if offload:
        states = [0.0, 0.0, 0.0]
    inputs = dict(model=spec.name, dp=dp, per_block=per_block, reshard_after_forward=rs,
                  param_dtype=param_dtype, reduce_dtype=reduce_dtype or param_dtype,
                  prefetch=prefetch, optimizer=optimizer, offload=offload)
    explain = _explain(inputs, shard, sum(numels), pb, tensors)
    return FSDPMemory(*states, unsharded_held=held, unsharded_peak=peak,
                      steps=STEP_BYTES[optimizer] * tensors, host=host, explain=explain,
                      inputs=inputs)


OPTIMIZERS = tuple(OPTIMIZER_BYTES)


def _explain(i, shard, numel, pb, tensors) -> dict:
    dp, pad = i["dp"], shard * i["dp"] - numel
    padding = f" (incl. {pad:,} padding elements over all ranks)" if pad else " (no padding)"
    where = "on the host (offload), 0 here" if i["offload"] else "exact"
    rs = i["reshard_after_forward"]
    after = {True: "freed after each block's forward", False: "kept from forward to backward"}.get(
        rs, f"kept as 1/{rs} shards after the forward")
    return {
        "params": f"4 B x {shard:,} elements: the padded 1/{dp} shard, fp32 master; {where}"
                  f"{padding}",
        "grads": f"4 B x the same shard: gradients reduce-scattered, kept in fp32; {where}",
        "optimizer_states": f"{OPTIMIZER_BYTES[i['optimizer']]} B x the shard ({i['optimizer']}"
                            f" moments, zeros_like the local shard); {where}",
        "unsharded_held": f"{pb} B ({i['param_dtype']}) x N x the padded shard of each unit "
                          f"still gathered between forward and backward: the root"
                          f"{'' if i['per_block'] else ' (here the whole model, one unit)'}"
                          f"{'' if rs is True else ', and what the blocks keep: ' + after}; exact",
        "unsharded_peak": f"the most unsharded parameters at once: the root + what earlier "
                          f"units keep + the unit being resharded (+ its 1/k copy); blocks "
                          f"{after}; prefetching ({i['prefetch']}) adds none; exact",
        "total": "sharded states + unsharded_peak: a lower bound (no activations, unsharded "
                 "gradients, flat all-gather outputs or reduce-scatter inputs)",
        "steps": f"4 B x {tensors} parameter tensors: AdamW's step counters (CPU), apart",
        "host": "sharded params + grads + optimizer states in host memory (CPUOffloadPolicy)",
    }
