"""Tensor parallelism priced per layer: communication vs compute, and why TP stays in a node.

    >>> c = tp_cost("llama2-7b", tp=8, link="nvlink4", gpu="h100-sxm", mfu=0.5, seq_len=4096)
    >>> c.comm_time, c.compute_time, c.ratio            # seconds per layer per micro-batch
    >>> c.efficiency_no_overlap, c.efficiency_full_overlap
    >>> c.memory.params, c.memory.activations           # bytes per rank (estimate_memory)
    >>> crossing_tp("llama2-7b", link="ib-ndr")          # smallest tp where comm >= compute

Sources: Megatron-LM (Shoeybi et al. 2019, §3), sequence parallelism (Korthikanti et al. 2022),
TP inside a server, PP across (Narayanan et al. 2021, §3.2). The model, term by term: `tp_cost`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit import validate
from labkit.comm import Collective, StepComm, step_communication
from labkit.flops import attention_flops_per_token
from labkit.hardware import GPU, Link, get_gpu, get_link
from labkit.memory import (FP8_PRECISIONS, PRECISIONS, MemoryEstimate, activation_value_bytes,
                           estimate_memory, tp_degrees, tp_splits)
from labkit.models import get_model

# the tensor-core mode each precision's matmuls run in (fp32: plain fp32, as PyTorch's default
# torch.backends.cuda.matmul.allow_tf32 = False)
COMPUTE_DTYPE = {"fp32": "fp32", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16": "bf16",
                 "fp8-mixed": "fp8"}
GPUS_PER_NODE = 8              # an HGX/DGX node: the NVLink domain TP is meant to stay in


@dataclass
class TPCost:
    """One rank's cost of one transformer layer and micro-batch (forward + backward) under TP."""

    comm: StepComm              # the layer's collectives (counts per layer per micro-batch)
    comm_time: float            # seconds, collectives back to back
    flops: float                # this rank's FLOPs for the layer
    compute_time: float         # seconds at peak x MFU
    memory: MemoryEstimate      # per rank, the whole model (estimate_memory)
    link: Link
    gpu: GPU
    inputs: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Communication time over compute time (> 1: TP communication dominates)."""
        return self.comm_time / self.compute_time

    @property
    def exposed_full_overlap(self) -> float:
        """Communication left on the critical path if it overlapped compute perfectly."""
        return max(0.0, self.comm_time - self.compute_time)

    @property
    def efficiency_no_overlap(self) -> float:
        """compute / (compute + comm): every collective on the critical path (Megatron-LM)."""
        return self.compute_time / (self.compute_time + self.comm_time)

    @property
    def efficiency_full_overlap(self) -> float:
        """compute / max(compute, comm): the best any overlap can do."""
        return self.compute_time / (self.compute_time + self.exposed_full_overlap)

    @property
    def leaves_node(self) -> bool:
        """Whether the TP group spans more than one node on an intra-node link (impossible:
        NVLink / PCIe reach only the GPUs of one node)."""
        return self.link.scope == "intra-node" and self.inputs["tp"] > GPUS_PER_NODE


def check_tp(model, tp) -> int:
    """`tp` if it splits `model` evenly (whole heads, whole KV heads, equal MLP slices), else a
    ValueError naming the counts and listing the degrees allowed."""
    spec = get_model(model)
    t = validate.positive_int("tp", tp, validate.MAX_RANKS)
    allowed = tp_degrees(spec)
    if t not in allowed:
        counts = ", ".join(f"{k}={v:,}" for k, v in tp_splits(spec).items())
        raise ValueError(f"tp={t} does not split {spec.name}: it must divide {counts}; allowed: "
                         f"{', '.join(str(d) for d in allowed)}")
    return t


def layer_flops(model, batch_size, seq_len, causal=False) -> float:
    """Training FLOPs of one transformer layer over b sequences of s tokens, all ranks together:
    (6 x params_per_layer + 3 x attention FLOPs per token and layer) x b s (`labkit.flops`)."""
    spec = get_model(model)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    s = validate.positive_int("seq_len", seq_len, validate.MAX_SEQ_LEN)
    attn = attention_flops_per_token(spec, s, causal) / spec.num_layers
    return (6 * spec.params_per_layer() + 3 * attn) * b * s


def layer_communication(model, tp, batch_size=1, seq_len=None, sequence_parallel=False,
                        activation_bytes=2) -> StepComm:
    """The collectives of one layer and micro-batch: `step_communication("tp")` (the whole
    model, one micro-batch) with each count divided by the number of layers."""
    spec = get_model(model)
    b = validate.positive_int("batch_size", batch_size, validate.MAX_BATCH)
    s = validate.positive_int("seq_len", spec.max_seq_len if seq_len is None else seq_len,
                              validate.MAX_SEQ_LEN)
    ab = validate.positive("activation_bytes", activation_bytes, validate.MAX_ELEMENT_BYTES)
    size = b * s * spec.hidden_size * ab
    if size > validate.MAX_BYTES:
        raise ValueError(f"batch_size={b:,} x seq_len={s:,} makes each collective carry "
                         f"{validate.show(float(size))} bytes (b s h x {ab:g} B); "
                         f"allowed: at most {validate.show(validate.MAX_BYTES)}: a smaller "
                         "batch_size or seq_len")
    step = step_communication("tp", model=spec, tp=tp, batch_size=batch_size, seq_len=seq_len,
                              sequence_parallel=sequence_parallel,
                              activation_bytes=ab)
    L = spec.num_layers
    return StepComm("tp", [Collective(c.op, c.count // L, c.nbytes, c.group, c.why)
                           for c in step.collectives],
                    notes=f"per layer and micro-batch ({L} layers)")


def tp_cost(model, tp, link="nvlink4", gpu="h100-sxm", mfu=0.5, batch_size=1, seq_len=None,
            precision="bf16-mixed", sequence_parallel=False, causal=False) -> TPCost:
    """Per-layer TP communication vs compute for one rank (the model: below).

    model: a preset name, ModelSpec or config. tp: the tensor-parallel degree (must divide the
    heads, the KV heads and the MLP width). link: a key of `labkit.hardware.LINKS` or a Link (the
    slowest link in the TP ring). gpu: a key of GPUS or a GPU. mfu: the share of the dense peak
    the matmuls reach, in (0, 1]. batch_size: sequences per micro-batch; seq_len: default the
    model's context. precision: as `estimate_memory` takes it; the activations' bytes on the wire
    and the tensor-core mode. sequence_parallel: all-gather + reduce-scatter instead of
    all-reduce (tp must then divide seq_len). causal: count half the attention scores' FLOPs.

    Everything is per transformer layer and micro-batch (forward + backward), on one
    tensor-parallel rank, t = tp, b = batch_size, s = seq_len, h = hidden_size:
    - communication (Megatron-LM, Shoeybi et al. 2019, §3 and Figure 4): the g operator
      all-reduces the b s h activations after attention and after the MLP in the forward, the f
      operator the input gradients in the backward: 4 all-reduces of S = b s h x activation
      bytes per layer, from `labkit.comm.step_communication("tp")` (its counts divided by the
      layers). With sequence parallelism each becomes an all-gather + a reduce-scatter of the
      same S (Korthikanti et al. 2022, §4.2.2): the same ring bytes, 2(t-1)/t S per all-reduce,
      and the same 2(t-1) latency steps. Time from `labkit.comm.collective_time` (ring,
      alpha-beta) on the link's per-direction bandwidth and latency: per layer
      4 x (2(t-1) alpha + 2(t-1)/t S / B).
    - compute: the layer's training FLOPs, 6 x params_per_layer x b s plus 3 x the forward
      attention FLOPs 4 (a d_head) s x b s (`labkit.flops`, PaLM's Appendix B;
      Kaplan et al. 2020 count half), split evenly over the t ranks, at peak x MFU (`labkit.hardware.GPUS`, dense).
    - the ratio comm / compute is about 8 (t-1) h x bytes x peak x MFU / (B x 6 x 12 h^2) for a
      GPT layer: it grows with t - 1 and falls with the bandwidth B; it does not depend on b
      (both sides scale with b s) and falls a little with s (the attention FLOPs grow with s).
      Llama-2-7B on H100s at 50 % MFU: on NVLink 4 (450 GB/s per direction) the ratio is 0.43
      at tp = 8, inside a node; over one InfiniBand NDR port per GPU (50 GB/s) it is 0.46
      already at tp = 2 and exceeds 1 from tp = 4. Hence Narayanan et al. 2021, §3.2: tensor
      parallelism up to the GPUs of a server (NVLink), pipeline parallelism across servers.
    - efficiency: compute / (compute + exposed communication), bounded by no overlap
      (Megatron-LM's TP collectives sit on the critical path: exposed = comm) and full overlap
      (exposed = max(0, comm - compute), what overlapping the collectives with the GEMMs could
      reach at best).
    - memory per rank: `labkit.memory.estimate_memory(tp=..., sequence_parallel=...)` (weights
      split over t; activations per Korthikanti et al. 2022, §4: only the parts inside the TP
      region shrink without sequence parallelism, everything with it).
    """
    spec = get_model(model)
    t = check_tp(spec, tp)
    validate.choice("precision", precision, PRECISIONS + FP8_PRECISIONS)
    validate.choice("sequence_parallel", sequence_parallel, (False, True))
    validate.choice("causal", causal, (False, True))
    u = validate.positive("mfu", mfu, 1.0)
    the_link, the_gpu = get_link(link), get_gpu(gpu)
    dtype = COMPUTE_DTYPE[precision]
    if dtype not in the_gpu.peak_flops:
        ok = [p for p, d in COMPUTE_DTYPE.items() if d in the_gpu.peak_flops]
        raise ValueError(f"precision={precision!r} runs its matmuls in {dtype}, for which gpu="
                         f"{the_gpu.name!r} has no peak figure; allowed on it: "
                         f"{', '.join(repr(p) for p in ok)}")
    s = validate.positive_int("seq_len", spec.max_seq_len if seq_len is None else seq_len,
                              validate.MAX_SEQ_LEN)
    if sequence_parallel and s % t:
        allowed = ", ".join(str(d) for d in sweep_degrees(spec, s, True))
        raise ValueError(f"tp={t} does not divide seq_len={s:,}, which sequence parallelism "
                         f"splits over the tp ranks; allowed tp: {allowed}")
    memory = estimate_memory(spec, batch_size=batch_size, seq_len=s, precision=precision, tp=t,
                             sequence_parallel=sequence_parallel)
    comm = layer_communication(spec, t, batch_size, s, sequence_parallel,
                               activation_value_bytes(precision))
    flops = layer_flops(spec, batch_size, s, causal) / t
    return TPCost(comm=comm, comm_time=comm.time(the_link.bandwidth, the_link.latency),
                  flops=flops, compute_time=flops / (the_gpu.flops(dtype) * u), memory=memory,
                  link=the_link, gpu=the_gpu,
                  inputs=dict(model=spec.name, tp=t, link=the_link.name, gpu=the_gpu.name,
                              mfu=u, batch_size=memory.inputs["batch_size"], seq_len=s,
                              precision=precision, sequence_parallel=sequence_parallel,
                              causal=causal))


def sweep_degrees(model, seq_len=None, sequence_parallel=False) -> list[int]:
    """The tp degrees `tp_cost` takes for `model` (with sequence parallelism, those that also
    divide seq_len)."""
    spec = get_model(model)
    s = spec.max_seq_len if seq_len is None else validate.positive_int(
        "seq_len", seq_len, validate.MAX_SEQ_LEN)
    return [t for t in tp_degrees(spec) if not sequence_parallel or s % t == 0]


def tp_sweep(model, degrees=None, **kwargs) -> dict[int, TPCost]:
    """{tp: tp_cost(model, tp, **kwargs)} for `degrees` (default: every degree allowed)."""
    if degrees is None:
        degrees = sweep_degrees(model, kwargs.get("seq_len"),
                                kwargs.get("sequence_parallel", False))
    return {t: tp_cost(model, t, **kwargs) for t in degrees}


def crossing_tp(model, degrees=None, **kwargs) -> int | None:
    """The smallest tp (of `degrees`, default every degree allowed) at which the layer's
    communication takes at least as long as its compute on this link; None if none does."""
    return first_crossing(tp_sweep(model, degrees, **kwargs))


def first_crossing(costs: dict) -> int | None:
    """The smallest tp of {tp: TPCost} whose communication takes at least its compute time."""
    return next((t for t, c in sorted(costs.items()) if c.comm_time >= c.compute_time), None)
