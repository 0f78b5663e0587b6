"""One GPU's model states: bytes per parameter, the parameters a GPU holds, how ZeRO shards
them, where they live (GPU or host memory) and what offloading moves over PCIe.

    >>> state_bytes("bf16-mixed", "adamw"), stage_params(get_model("llama2-7b"), tp=2, pp=4)
    >>> gpu, host = model_states(7e9, 2, (2, 0), 12, zero_stage=2, dp=8, offload="optimizer")
    >>> offload_traffic("llama2-7b", offload="optimizer", zero_stage=2, dp=8).time   # seconds

Sources: ZeRO (Rajbhandari et al. 2020), ZeRO-Offload (Ren et al. 2021), DeepSpeed's and
FSDP2's offload options; the rules are in `model_states` and `offload_traffic`. Below
`labkit.memory`, which re-exports these names. Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
import numbers

from labkit import validate
from labkit.hardware import Link, get_link
from labkit.models import ModelSpec, get_model
from labkit.precision import gradient_bytes

PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
# Accepted by the estimators, kept out of PRECISIONS (what the CPU labs and exercises run).
FP8_PRECISIONS = ("fp8-mixed",)
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit")
OFFLOAD = ("none", "optimizer", "params")


def state_bytes(precision: str = "bf16-mixed", optimizer: str = "adamw",
                grad_accum: str = "param") -> tuple[int, int, int]:
    """(weight, gradient, optimizer-state) bytes per parameter.

    - "fp32": 4-byte weights and gradients; optimizer states in fp32.
    - "fp16-mixed" / "bf16-mixed": 2-byte weights and gradients for the forward and backward,
      and a 4-byte fp32 master copy of the weights counted in the optimizer states (ZeRO §3.1,
      Micikevicius et al. 2018). Optimizer moments in fp32.
    - "bf16": weights, gradients and moments all bf16, no master copy (what `torch.optim` does
      for bf16 parameters: its states are `zeros_like(param)`).
    - "fp8-mixed" (Transformer Engine): as "bf16-mixed"; matmul inputs are cast to FP8 on the
      fly (`labkit.precision`), so the model states do not shrink (TE's optional cache of FP8
      weight copies across micro-batches, 1-2 B/param, is not counted).

    grad_accum: "param" (gradients in the weights' dtype, ZeRO's count), "fp32" (Megatron-LM's
    fp32 main_grad) or "both" (16-bit gradients + an fp32 copy for the step):
    `labkit.precision.gradient_bytes`.

    Optimizer states per parameter: sgd none; sgd-momentum one buffer; adam / adamw two moments
    (exp_avg, exp_avg_sq); adamw-8bit two 1-byte moments (bitsandbytes' block-wise 8-bit Adam,
    Dettmers et al. 2022; the per-block fp32 scales, 4 bytes per 2048 values, are ignored).
    """
    validate.choice("precision", precision, PRECISIONS + FP8_PRECISIONS)
    validate.choice("optimizer", optimizer, OPTIMIZERS)
    weight = 4 if precision == "fp32" else 2
    master = 4 if precision.endswith("-mixed") else 0
    moment = 2 if precision == "bf16" else 4
    moments = {"sgd": 0, "sgd-momentum": moment, "adam": 2 * moment, "adamw": 2 * moment,
               "adamw-8bit": 2}[optimizer]
    return weight, sum(gradient_bytes(weight, grad_accum)), master + moments


def _stage_layers(num_layers: int, pp: int, uneven: bool = False) -> list[int]:
    # As even as possible; the first L % pp stages take one more layer. uneven: the embedding
    # and the output layer each take one layer's slot, on the first and the last stage (Llama 3
    # 405B: one transformer layer fewer there; Megatron-LM's --account-for-embedding-in-
    # pipeline-split and --account-for-loss-in-pipeline-split).
    if not uneven or pp == 1:
        return [num_layers // pp + (1 if i < num_layers % pp else 0) for i in range(pp)]
    out = _stage_layers(num_layers + 2, pp)
    out[0] -= 1
    out[-1] -= 1
    return out


stage_layers = _stage_layers


def stage_params(spec: ModelSpec, tp: int, pp: int, uneven: bool = False, ep: int = 1,
                 etp: int = 1, experts: bool = True) -> list[float]:
    """Parameters held by one GPU of each pipeline stage (one tensor-parallel rank).

    Weight matrices and column-parallel biases are split over tp; norms and row-parallel biases
    are replicated (Megatron-LM, Shoeybi et al. 2019). The embedding and the LM head are split
    over the vocabulary (vocab-parallel; Megatron pads the vocabulary, ignored here). The first
    stage holds the embeddings, the last the final norm and the head; with tied embeddings and
    pp > 1 the last stage keeps its own copy of the shared matrix (Megatron-LM does this and
    all-reduces the two copies' gradients), with pp = 1 the one tensor serves both. uneven:
    one transformer layer fewer on the first and last stages (`_stage_layers`).

    A mixture of experts: each MoE layer's routed experts are split over ep x etp (expert
    parallelism, expert tensor parallelism); an MoE model's first `dense_layers` layers sit on
    the first stages. experts=False: leave the routed experts out (`stage_expert_params` has
    them), as ZeRO shards them over another group.
    """
    counts = _stage_layers(spec.num_layers, pp, uneven)
    vh = spec.vocab_size * spec.hidden_size
    embed = vh / tp + (spec.max_seq_len * spec.hidden_size if spec.learned_positions else 0)
    head = vh / tp if (not spec.tied_embeddings or pp > 1) else 0.0

    def per_layer(dense):
        parts = spec.layer_parts(dense=dense)
        return ((parts["attention_sharded"] + parts["mlp_sharded"]) / tp + parts["replicated"]
                + (parts.get("experts", 0) / (ep * etp) if experts else 0.0))

    moe, dense = per_layer(False), per_layer(True)
    out, first = [], 0
    for n in counts:
        k_dense = max(0, min(n, spec.dense_layers - first)) if spec.is_moe else 0
        out.append(k_dense * dense + (n - k_dense) * moe)
        first += n
    out[0] += embed
    out[-1] += spec.final_norm_params() + head
    return out


def stage_expert_params(spec: ModelSpec, pp: int, ep: int = 1, etp: int = 1,
                        uneven: bool = False) -> list[float]:
    """Routed-expert parameters one GPU of each stage holds: its MoE layers' experts / (ep x
    etp); zeros for a dense model."""
    if not spec.is_moe:
        return [0.0] * pp
    per_layer = spec.num_experts * spec.expert_params() / (ep * etp)
    out, first = [], 0
    for n in _stage_layers(spec.num_layers, pp, uneven):
        out.append((n - max(0, min(n, spec.dense_layers - first))) * per_layer)
        first += n
    return out


def check_placement(zero_stage: int, offload: str, gathered) -> float:
    """Validate `offload` and `gathered` for `zero_stage`; return gathered as a float (0: none)."""
    validate.choice("offload", offload, OFFLOAD)
    if offload == "optimizer" and zero_stage < 1:
        raise ValueError(f"offload='optimizer' needs zero_stage >= 1 (ZeRO-Offload partitions the "
                         f"step over dp); got zero_stage={zero_stage}; allowed: 1, 2, 3")
    if offload == "params" and zero_stage != 3:
        raise ValueError(f"offload='params' needs zero_stage=3 (only sharded weights can stay on "
                         f"the host); got zero_stage={zero_stage}")
    if gathered is None:
        return 0.0
    if zero_stage != 3:
        raise ValueError(f"largest_layer={gathered!r} counts the unit ZeRO-3 gathers; with "
                         f"zero_stage={zero_stage} every weight is resident: leave it None")
    return validate.positive("largest_layer", gathered, validate.MAX_PARAMS)


def model_states(n, weight, grads, optimizer, zero_stage=0, dp=1, offload="none",
                 gathered=0.0) -> tuple[dict, dict]:
    """(GPU bytes, host bytes) of the model states of a GPU holding `n` parameters of its
    replica, each a dict with "params", "grads", "optimizer_states".

    weight, optimizer: bytes per parameter; grads: (accumulated, step copy) bytes per parameter
    (`labkit.precision.gradient_bytes`); gathered: parameters of the unit ZeRO-3 gathers.

    Sharding (Rajbhandari et al. 2020): ZeRO-1 shards the optimizer states (and the fp32
    gradient copy the step reads, `labkit.precision.gradient_bytes`), ZeRO-2 also the
    accumulated gradients, ZeRO-3 also the weights. Under ZeRO-3 a unit's weights are
    all-gathered before use and its gradient exists whole until its reduce-scatter: `gathered`
    parameters (DeepSpeed's `largest_layer_params`, an FSDP wrapping unit) add their weights and
    gradients, both in the weights' dtype (DeepSpeed's estimator: 4 bytes per parameter of the
    largest layer).

    Offload (`offload=`):
    - "optimizer" (ZeRO-Offload, Ren et al. 2021; DeepSpeed `offload_optimizer`): the optimizer
      step runs on the CPU, so the optimizer states, the fp32 master weights and the gradients
      the step reads live in host memory; the GPU keeps the 16-bit weights and, under ZeRO-1,
      the whole gradient it accumulates before the reduce-scatter. Needs zero_stage >= 1.
    - "params" (DeepSpeed `offload_param` + `offload_optimizer`, ZeRO-Infinity; FSDP2
      `CPUOffloadPolicy`): the weight shards live on the host too; the GPU holds only the
      gathered unit. Needs zero_stage = 3.
    Host bytes are this GPU's share; a node's host memory holds the shares of all its GPUs."""
    acc, copy = grads

    def share(stage):
        return dp if zero_stage >= stage else 1

    weights, states = n * weight / share(3), n * optimizer / share(1)
    grad_acc, grad_copy = n * acc / share(2), n * copy / share(1)
    host = {"params": 0.0, "grads": 0.0, "optimizer_states": 0.0}
    if offload != "none":
        # the step reads this GPU's gradient shard on the host; under ZeRO-1 the GPU also
        # keeps the whole gradient it accumulates, from ZeRO-2 only the shard exists
        host["optimizer_states"], states = states, 0.0
        host["grads"] = grad_copy + (n * acc / dp if zero_stage == 1 else grad_acc)
        grad_copy, grad_acc = 0.0, (grad_acc if zero_stage == 1 else 0.0)
    if offload == "params":
        host["params"], weights = weights, 0.0
    gpu = {"params": weights + gathered * weight, "grads": grad_acc + grad_copy + gathered * weight,
           "optimizer_states": states}
    return gpu, host


def describe_placement(explain: dict, grad_accum: str, offload: str, gathered: float,
                       host: dict) -> dict:
    """The `explain` entries of `labkit.memory.estimate_memory` that these options change."""
    out = {}
    notes = {"params": [], "grads": [], "optimizer_states": []}
    if grad_accum != "param":
        notes["grads"].append({"fp32": "fp32 gradients (Megatron main_grad)",
                               "both": "16-bit gradients + an fp32 copy for the step (sharded "
                                       "from ZeRO-1)"}[grad_accum])
    if gathered:
        for name in ("params", "grads"):
            notes[name].append(f"+ a gathered unit of {gathered:,.0f} parameters (ZeRO-3)")
    if offload != "none":
        for name, value in host.items():
            if value:
                notes[name].append(f"{value / 1e9:,.2f} GB of it in host memory "
                                   f"(offload={offload!r}), not in total")
    for name, extra in notes.items():
        if extra:
            out[name] = f"{explain.get(name, '')}; " + "; ".join(extra)
    if offload != "none":
        out["host (offload)"] = f"model states in host memory (offload={offload!r}), not in total"
    return out


@dataclass
class OffloadTraffic:
    """Bytes one GPU moves over its host link per training step, each direction apart."""

    host_to_device: float
    device_to_host: float
    link: Link
    explain: str = ""

    @property
    def time(self) -> float:
        """Seconds at the link's per-direction bandwidth; the two directions run at once
        (PCIe is full duplex), so the busier one sets the time. Latency is not counted."""
        return max(self.host_to_device, self.device_to_host) / self.link.bandwidth


def offload_traffic(model, offload="optimizer", zero_stage=2, dp=1, tp=1, pp=1,
                    precision="bf16-mixed", grad_accum="param", microbatches=1,
                    link="pcie5") -> OffloadTraffic:
    """PCIe traffic of one GPU per step under `offload` (model: a preset, ModelSpec, config or a
    parameter count; the GPU holds its pipeline stage's share over tp, the busiest stage).

    - "optimizer": device to host, this GPU's gradient shard, once per step under ZeRO-1 (it
      accumulates whole gradients on the GPU) and after every micro-batch under ZeRO-2/3 (the
      GPU keeps no shard); host to device, the updated 16-bit weight shard, once per step
      (ZeRO-Offload, Ren et al. 2021, §4: 2M bytes each way for M fp16 parameters).
    - "params": host to device, the weight shard before each all-gather (forward and backward of
      every micro-batch); device to host, the gradient shard after every micro-batch.
    Gradients cross in their accumulated dtype (`gradient_bytes`: fp32 for grad_accum="fp32")."""
    validate.choice("zero_stage", zero_stage, (0, 1, 2, 3))
    check_placement(zero_stage, offload, None)
    if offload == "none":
        raise ValueError("offload='none' moves nothing over PCIe; allowed: 'optimizer', 'params'")
    dp, tp = (validate.positive_int(k, v, validate.MAX_RANKS) for k, v in (("dp", dp), ("tp", tp)))
    pp = validate.positive_int("pp", pp, validate.MAX_LAYERS)
    m = validate.positive_int("microbatches", microbatches, validate.MAX_BATCH)
    w = state_bytes(precision)[0]
    g = gradient_bytes(w, grad_accum)[0]
    if isinstance(model, numbers.Real) and not isinstance(model, bool):
        n = validate.positive("model (parameter count)", model, validate.MAX_PARAMS) / (tp * pp)
    else:
        n = max(stage_params(get_model(model), tp, pp))
    shard = n / dp
    if offload == "optimizer":
        sends = 1 if zero_stage == 1 else m
        d2h, h2d = sends * shard * g, shard * w
        how = (f"gradient shard ({g} B/param) x {sends} to the host, updated weight shard "
               f"({w} B/param) back")
    else:
        d2h, h2d = m * shard * g, 2 * m * shard * w
        how = (f"weight shard ({w} B/param) to the GPU before each of {2 * m} all-gathers, "
               f"gradient shard ({g} B/param) x {m} to the host")
    link = get_link(link)
    return OffloadTraffic(h2d, d2h, link, f"{n / dp:,.0f} parameters per shard: {how}; "
                                          f"over {link.name} per direction")
