"""Time of one transformer layer's kernels on one GPU, and the host's time to launch them.

    >>> layer_seconds("llama3-8b", "h100-sxm", tokens=4096, seq_len=4096)   # LayerTime
    >>> gemm_seconds(4096, 4096, 4096, "h100-sxm")                  # one bf16 matmul, seconds

What the planner's step time is made of (`labkit.planner_cost`): matmuls on a roofline with a
measured ceiling and a fixed cost per kernel (small shards are slower per FLOP), FlashAttention
at its measured efficiency, memory-bound elementwise work (norms, rotary, SwiGLU, residuals, the
loss) at HBM bandwidth, and the host: a micro-batch takes at least the time the framework's
Python needs to launch its kernels. Every constant is named below, with its source. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import validate
from labkit.hardware import get_gpu
from labkit.models import get_model

KERNEL_LATENCY = 4e-6
# s: the fixed device cost of one kernel (launch, ramp-up, tail): a 1024^3 bf16 matmul on an H100
# (2.1 GFLOP) then reaches ~30 % of peak, 4096^3 ~70 %, as measured GEMM sweeps show (NVIDIA,
# "Matrix Multiplication Background User's Guide": throughput rises with size and saturates).


@dataclass(frozen=True)
class DeviceFacts:
    """What a GPU reaches in practice, as shares of its dense peak: the largest matmuls
    (`gemm`, measured maximum achievable matmul FLOPs over peak) and FlashAttention's forward
    and backward together (`attention`)."""

    gemm: float
    attention: float
    source: str


_MAMF = ("Bekman, Machine Learning Engineering, 'Maximum Achievable Matmul FLOPS comparison "
         "table' (torch bf16 matmul, best shape of a search, mean of 100 iterations)")
_FA2 = "FlashAttention-2 (Dao 2023, Fig. 4), forward + backward, causal, head dim 128, 16K"
FACTS = {
    "NVIDIA A100 80GB SXM": DeviceFacts(
        0.869, 0.61, _MAMF + ": A100 SXM 271.2 of 312 TFLOP/s; " + _FA2 + ": 189 of 312"),
    "NVIDIA H100 SXM 80GB": DeviceFacts(
        0.803, 0.34, _MAMF + ": H100 SXM 794.5 of 989 TFLOP/s (FlashAttention-3, Shah et al. "
        "2024, §1: optimised GEMMs reach 80-90 % on H100); FlashAttention-2 on H100 reaches up "
        "to 335 TFLOP/s (Dao 2023, §4.1), FlashAttention-3 ~0.55 of peak"),
    "NVIDIA B200 (HGX/DGX B200, per GPU)": DeviceFacts(
        0.776, 0.40, _MAMF + ": B200 1,745 of 2,250 TFLOP/s; attention assumed"),
}
FACTS["NVIDIA A100 40GB SXM"] = FACTS["NVIDIA A100 80GB SXM"]
FACTS["NVIDIA H200 SXM 141GB"] = FACTS["NVIDIA H100 SXM 80GB"]   # the same chip (MAMF table)
DEFAULT_FACTS = DeviceFacts(0.75, 0.40, "assumed for a GPU without a measured figure here")
SUSTAINED = 0.85
# The share of those benchmark figures a training run sustains for hours. MAMF is measured in a
# short, controlled benchmark; a workload *delivers* less (AMD ROCm blog, "Understanding Peak,
# Max-Achievable & Delivered FLOPs", 2025): clocks fall under the power limit on continuous
# matmuls (NVIDIA developer forums, "About GPU peak performance": power capping), and real
# shapes are not the best one. 0.85 is labkit's choice, not a measurement: checked against the
# published runs (labkit.field: 2021-22 A100 runs and Llama 3 405B within 15 %, except MT-NLG).

# Elementwise traffic, bytes per token of one layer's FORWARD, as multiples of (h, q + kv, f):
# each op reads its inputs and writes its output once, 16-bit values unless noted; backward
# moves twice the forward's bytes (gradients in and out of every op).
# - "fused" (Megatron-LM / TransformerEngine kernels): two RMSNorms fused with the residual add
#   (read x and the residual, write both: 8h each), fused rotary on q and k (read and write:
#   4 (q + kv)), fused SwiGLU (read gate and up, write the product: 6f).
# - "eager" (each op its own kernel, as transformers or nanotron's Python layers): RMSNorm in
#   fp32 (upcast, square, mean, rsqrt-multiply, downcast, weight: ~46h bytes each), two residual
#   adds (6h each), rotary as rotate_half + 2 multiplies + add on q and k (~20 (q + kv)), the
#   head transposes copied contiguous (4 (q + 2 kv)), SiLU then multiply (10f).
ELEMENTWISE = {"fused": (16, 4, 6, 0), "eager": (104, 24, 10, 4)}
# Bytes per logit of the loss (forward and backward): fused vocab-parallel cross-entropy reads
# the 16-bit logits and writes their gradient, fp32 inside (~12); eager upcasts the logits to
# fp32, log-softmax, gather, and their backward (~30).
LOSS_BYTES = {"fused": 12, "eager": 30}
# Bytes per attention score with eager attention, forward and backward: the fused scale-mask-
# softmax reads and writes the 16-bit scores (4), dropout writes its 1-byte mask and the dropped
# scores (3 + read 2); backward reads them again and writes their gradients (~2x).
SCORE_BYTES = 27
# Bytes per logit alive at the loss's peak beyond the fp32 log-softmax kept for backward (what
# labkit.memory counts): eager, the 16-bit logits, their fp32 upcast, and in backward the fp32
# gradient and its 16-bit copy (2 + 4 + 4 + 2); fused, the 16-bit logits and their gradient.
LOSS_PEAK_BYTES = {"fused": 4, "eager": 12}


@dataclass(frozen=True)
class Framework:
    """How a training framework runs a layer: its elementwise kernels ("fused" / "eager"), the
    host (CPU) seconds to launch one layer's forward and backward for one micro-batch, and the
    host seconds a pipeline stage waits per layer, micro-batch and TP rank when its hops cross
    nodes with TP inside it (`pp_tp_wait`: a framework's own cost, 0 where none was measured). `blocking`: the
    launches wait for their kernels (CUDA_LAUNCH_BLOCKING=1), so the host time adds to the
    device time instead of running ahead of it. `fsdp_prefetch`: FSDP issues a layer's gather
    before the layer runs (PyTorch FSDP's forward / backward prefetch, FSDP2); without it each
    gather is waited for. `overlap_param_gather`: ZeRO-1/2's gather of the updated weights runs
    behind the next step's forward (Megatron-LM's distributed optimizer, overlap_param_gather);
    without it (DeepSpeed's ZeRO-1 in Megatron-DeepSpeed, nanotron) the gather follows the
    optimizer step with nothing to hide behind."""

    name: str
    kernels: str
    host_per_layer: float
    source: str
    pp_tp_wait: float = 0.0
    blocking: bool = False
    fsdp_prefetch: bool = True
    overlap_param_gather: bool = True


# Megatron-DeepSpeed's host seconds per layer and micro-batch with blocking launches: the
# least-squares fit over BigScience's measured layouts (labkit.field_bloom.fit_host;
# tests/cost/test_field_bloom.py checks that it still agrees with the data).
MEGATRON_DEEPSPEED_HOST = 16.5e-3
# nanotron's wait per layer, micro-batch and TP rank where a pipeline hop crosses nodes with TP
# inside a stage: the median over the Ultra-Scale Playbook's host-bound runs
# (labkit.field.fit_pp_tp_wait; tests/cost/test_field.py checks that it still agrees).
NANOTRON_PP_TP_WAIT = 3.3e-3

FRAMEWORKS = {
    "megatron": Framework(
        "Megatron-LM / production kernels", "fused", 0.4e-3,
        "assumed order of magnitude: ~40 fused kernels per layer forward and backward at ~10 us "
        "of eager PyTorch host time each (He, 'Making Deep Learning Go Brrrr From First "
        "Principles', 2022: overhead)"),
    "nanotron": Framework(
        "nanotron (eager PyTorch layers)", "eager", 4.5e-3,
        "measured on the Ultra-Scale Playbook's sweep (labkit.field): at micro-batch 1 on one "
        "node the 1B model takes 73-74 ms per micro-batch at tp 2, 4 and 8 alike (16 layers), "
        "the 8B 141 ms at tp 8 (32 layers): the host, not the GPU, sets the pace there. Where "
        "a pipeline hop crosses nodes with TP inside a stage, each layer of a micro-batch takes "
        "a further ~3.3 ms per TP rank (at micro-batch 1: ~10-12 ms per layer at tp 2, 14-19 at "
        "tp 4, 23-27 at tp 8, for both models and any pp; within one node, 5-6 ms at any tp): "
        "nanotron's own cost, measured, not explained by the hardware. Its ZeRO-1 gathers the "
        "updated weights after the optimizer step (nanotron/optim/zero.py)",
        pp_tp_wait=NANOTRON_PP_TP_WAIT, overlap_param_gather=False),
    "metaseq": Framework(
        "metaseq (OPT): Megatron-LM's tensor-parallel layers under FairScale's FSDP", "fused",
        0.4e-3,
        "Megatron-LM's layers and host time (as 'megatron'); FairScale's FSDP (2021) gathers a "
        "unit's parameters in that unit's own forward and pre-backward hooks and waits for them "
        "(fairscale/nn/data_parallel/fully_sharded_data_parallel.py, _rebuild_full_params): no "
        "prefetch, which PyTorch's FSDP added in 2022", fsdp_prefetch=False),
    "megatron-deepspeed": Framework(
        "Megatron-DeepSpeed as BLOOM ran it (DeepSpeed's pipeline engine, blocking launches)",
        "fused", MEGATRON_DEEPSPEED_HOST,
        "measured on BigScience's search for BLOOM's layout (labkit.field_bloom: 60 runs on "
        "48 nodes of 8 A100s, TP 1-8, PP 1-48, micro-batch 1-8): the seconds per iteration "
        "beyond labkit's device time grow as layers x micro-batches on a stage, "
        "by a least-squares fit; the run set CUDA_LAUNCH_BLOCKING=1 (tr11-176B-ml.slurm: 'do "
        "not remove or the training will hang'), which makes each launch wait for its kernel, "
        "so the host time adds to the device time. DeepSpeed's ZeRO-1 gathers the updated "
        "weights after the optimizer step", blocking=True, overlap_param_gather=False),
}


ATTENTION_HALF_TOKENS = 450
# FlashAttention reaches a share L / (L + 450) of its long-sequence rate on L keys per block:
# FlashAttention-2's forward + backward (Dao 2023, Fig. 4, causal, head dim 128) runs at 52 %
# of its 16K rate at 512 tokens, 69 % at 1K, 82 % at 2K, 93 % at 4K. `DeviceFacts.attention`
# is the 16K figure.


def attention_ramp(keys) -> float:
    """FlashAttention's rate on blocks of `keys` keys, relative to `DeviceFacts.attention`."""
    return (keys / (keys + ATTENTION_HALF_TOKENS)) / (16384 / (16384 + ATTENTION_HALF_TOKENS))


def facts_for(gpu) -> DeviceFacts:
    return FACTS.get(get_gpu(gpu).name, DEFAULT_FACTS)


def matmul_efficiency(gpu) -> float:
    """The share of dense peak labkit prices a large matmul at: measured ceiling x SUSTAINED."""
    return facts_for(gpu).gemm * SUSTAINED


def gemm_seconds(m, n, k, gpu, efficiency=None, dtype="bf16", value_bytes=2) -> float:
    """One (m x k) @ (k x n) matmul: the slower of its FLOPs at `efficiency` x peak (default:
    the GPU's measured ceiling x SUSTAINED, `matmul_efficiency`) and its bytes at HBM bandwidth,
    plus KERNEL_LATENCY."""
    g = get_gpu(gpu)
    eff = matmul_efficiency(g) if efficiency is None else efficiency
    compute = 2 * m * n * k / (g.flops(dtype) * eff)
    memory = value_bytes * (m * k + k * n + m * n) / g.memory_bandwidth
    return max(compute, memory) + KERNEL_LATENCY


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one layer (or the head) for one micro-batch on one GPU, forward + backward
    (+ the recomputed forward): by kind, and the host's launch time."""

    matmul: float
    attention: float
    elementwise: float
    host: float

    @property
    def device(self) -> float:
        return self.matmul + self.attention + self.elementwise


def layer_seconds(model, gpu, *, tokens, seq_len, tp=1, cp=1, sequence_parallel=False,
                  recompute="none", framework="megatron", efficiency=None, dtype="bf16",
                  value_bytes=2, attention="flash", ep=1, capacity_factor=None) -> LayerTime:
    """One transformer layer on one GPU: `tokens` = b x seq_len / cp tokens of this rank,
    weights split over tp. Forward matmuls (m = tokens): QKV, output, MLP in (gate and up),
    MLP out; backward: each one's input gradient and weight gradient (same FLOPs, transposed
    shapes). Causal FlashAttention: forward 2 b s^2 q / (cp tp) FLOPs (the causal half of
    4 b s^2 q), backward 2.5x the forward, at the GPU's attention efficiency; attention="eager"
    (scores materialised, as Megatron-LM ran before FlashAttention): the two batched matmuls
    per head on the matmul roofline, over the whole s x s scores, and the softmax, mask and
    dropout at HBM bandwidth (`SCORE_BYTES` per score). Elementwise:
    `ELEMENTWISE`, h-wide traffic split over tp only with sequence parallelism. recompute
    "full" adds the forward again, "selective" the attention forward.

    A mixture of experts (an MoE layer; an MoE model's few dense layers are priced as MoE
    ones): the router, the shared experts as a dense MLP, and the routed experts as grouped
    GEMMs (one launch per kind): this rank's tokens (/ tp: sequence parallelism splits them
    before dispatch) x k x capacity_factor spread evenly over its num_experts / ep experts, so
    each expert's GEMMs shrink as ep grows; plus the permutation copies at HBM bandwidth.
    Multi-head latent attention: its low-rank q and kv projections."""
    spec, g = get_model(model), get_gpu(gpu)
    fw = framework if isinstance(framework, Framework) else FRAMEWORKS[
        validate.choice("framework", framework, FRAMEWORKS)]
    attention_share = facts_for(g).attention * SUSTAINED
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_size
    T, b = tokens, tokens * cp / seq_len
    if spec.mla:
        q_lora, kv_lora, nope, rope, v = spec.mla
        a_ = spec.num_heads
        shapes = ([(h, q_lora), (q_lora, a_ * (nope + rope) / tp)] if q_lora else
                  [(h, a_ * (nope + rope) / tp)])
        shapes += [(h, kv_lora + rope), (kv_lora, a_ * (nope + v) / tp), (a_ * v / tp, h)]
    else:
        shapes = [(h, (q + 2 * kv) / tp), (q / tp, h)]
    moe = spec.is_moe
    if moe:
        f = spec.expert_ffn * spec.shared_experts      # the shared experts, a dense MLP
        shapes += [(h, 2 * f / tp), (f / tp, h)] if f else []
        shapes += [(h, spec.num_experts)]              # the router
    else:
        shapes += [(h, (2 if spec.gated_mlp else 1) * f / tp), (f / tp, h)]

    def gemm(m, n, k):
        return gemm_seconds(m, n, k, g, efficiency, dtype, value_bytes)

    fwd = sum(gemm(T, n, k) for k, n in shapes)
    bwd = sum(gemm(T, k, n) + gemm(k, n, T) for k, n in shapes)
    routed = 0.0
    if moe:
        local = spec.num_experts / ep
        assigned = T / tp * spec.experts_per_token * (capacity_factor or 1.0)
        m_e, fe = assigned / local, spec.expert_ffn

        def grouped(m, n, k):                          # `local` experts in one launch
            return local * (gemm(m, n, k) - KERNEL_LATENCY) + KERNEL_LATENCY

        e_fwd = grouped(m_e, 2 * fe, h) + grouped(m_e, h, fe)
        e_bwd = (grouped(m_e, h, 2 * fe) + grouped(h, 2 * fe, m_e) + grouped(m_e, fe, h)
                 + grouped(fe, h, m_e))
        # permute / unpermute, forward and backward: the k copies of each token's h values
        permute = 4 * 2 * assigned * h * value_bytes / g.memory_bandwidth
        fwd, bwd = fwd + e_fwd, bwd + e_bwd
        routed = fe * spec.experts_per_token * (capacity_factor or 1.0) / tp
        f = spec.expert_ffn * spec.shared_experts
    if attention == "flash":
        # each of the cp ring steps runs the kernel on a block of seq_len / cp keys
        attn_fwd = (2 * b * seq_len ** 2 * q / (cp * tp)
                    / (g.flops(dtype) * attention_share * attention_ramp(seq_len / cp))
                    + cp * KERNEL_LATENCY)
        attn_all = 3.5 * attn_fwd
    else:
        heads, d, s = b * spec.num_heads / tp, spec.d_head, seq_len
        one = heads * (gemm_seconds(T / b, s, d, g, efficiency, dtype, value_bytes)
                       + gemm_seconds(T / b, d, s, g, efficiency, dtype, value_bytes)
                       - 2 * KERNEL_LATENCY) + 2 * KERNEL_LATENCY
        scores = heads * T / b * s * SCORE_BYTES / g.memory_bandwidth
        attn_fwd = one + scores / 3
        attn_all = 3 * one + scores
    ch, cq, cf, ct = ELEMENTWISE[fw.kernels]
    whole = tp if sequence_parallel else 1
    ew_fwd = T * (ch * h / whole + cq * (q + kv) / tp + cf * (f / tp + routed)
                  + ct * (q + 2 * kv) / tp) / g.memory_bandwidth
    if moe:
        ew_fwd += permute / 3
    extra = {"none": (0, 0, 0), "selective": (0, attn_fwd, 0),
             "full": (fwd, attn_fwd, ew_fwd)}[validate.choice("recompute", recompute,
                                                              ("none", "selective", "full"))]
    return LayerTime(fwd + bwd + extra[0], attn_all + extra[1], 3 * ew_fwd + extra[2],
                     fw.host_per_layer)


def head_seconds(model, gpu, *, tokens, tp=1, framework="megatron", efficiency=None,
                 dtype="bf16", value_bytes=2) -> LayerTime:
    """The output layer and the loss for one micro-batch on one GPU (the last pipeline stage):
    the (tokens x h) @ (h x V / tp) matmul forward and backward, and `LOSS_BYTES` per logit."""
    spec, g = get_model(model), get_gpu(gpu)
    fw = framework if isinstance(framework, Framework) else FRAMEWORKS[framework]
    h, V = spec.hidden_size, spec.vocab_size / tp
    mm = sum(gemm_seconds(m, n, k, g, efficiency, dtype, value_bytes)
             for m, n, k in ((tokens, V, h), (tokens, h, V), (h, V, tokens)))
    loss = tokens * V * LOSS_BYTES[fw.kernels] / g.memory_bandwidth
    return LayerTime(mm, 0.0, loss, 0.0)


def optimizer_seconds(params, gpu, bytes_per_param=32) -> float:
    """A fused AdamW step over `params` parameters held by this GPU: memory-bound, reading and
    writing the fp32 master weight, both moments, the gradient and the 16-bit copy (~32 bytes
    per parameter) at HBM bandwidth."""
    return params * bytes_per_param / get_gpu(gpu).memory_bandwidth
