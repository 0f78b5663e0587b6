"""Answers of the tensor-parallel questions (labkit/quiz/data/tp.yaml).

Every number comes from labkit's cost models: the collectives of a layer from
`labkit.tp.layer_communication` (= `labkit.comm.step_communication("tp")` per layer), their time
against the layer's compute from `labkit.tp.tp_cost`, activation bytes from
`labkit.memory.activation_bytes_per_layer` (Korthikanti et al. 2022, Table 2). Numeric answers
return {"answer": value in the question's unit, **intermediates}; `verify_*` functions return
{"holds": bool, **intermediates} for choice questions.
"""
from __future__ import annotations

from labkit.comm import bytes_sent_per_rank, step_communication
from labkit.memory import activation_bytes_per_layer, activation_value_bytes
from labkit.models import get_model
from labkit.tp import layer_communication, tp_cost

MB, GB, US = 1e6, 1e9, 1e-6


def _counts(comm) -> dict:
    return {op: count for op, (count, _) in comm.by_op.items()}


def allreduces_per_layer(model, tp):
    """All-reduces one transformer layer issues per micro-batch and training step (Megatron TP,
    no sequence parallelism, no recompute): the g operators of the forward (after attention and
    after the MLP) and the f operators of the backward."""
    c = layer_communication(model, tp)
    fwd, bwd = (x.count for x in c.collectives)
    return {"answer": _counts(c)["all_reduce"], "fwd": fwd, "bwd": bwd}


def allreduces_per_step(model, tp, microbatches, pp=1):
    """All-reduces of one TP rank in one training step over `microbatches` micro-batches, on a
    pipeline stage of ceil(L / pp) layers."""
    spec = get_model(model)
    c = layer_communication(spec, tp)
    step = step_communication("tp", model=spec, tp=tp, pp=pp, microbatches=microbatches)
    layers = -(-spec.num_layers // pp)
    return {"answer": _counts(step)["all_reduce"], "layers": layers,
            "per_layer": _counts(c)["all_reduce"], "num_layers": spec.num_layers}


def bytes_per_layer_mb(model, tp, batch_size, seq_len):
    """MB (1e6 bytes) one TP rank sends per layer and micro-batch, ring all-reduces."""
    spec = get_model(model)
    c = layer_communication(spec, tp, batch_size, seq_len)
    size = c.collectives[0].nbytes
    return {"answer": c.total_bytes / MB, "S_mb": size / MB, "count": _counts(c)["all_reduce"],
            "each_mb": bytes_sent_per_rank("all_reduce", size, tp) / MB,
            "hidden": spec.hidden_size}


def verify_sp_same_bytes(model, tp, batch_size, seq_len):
    """With sequence parallelism each all-reduce becomes an all-gather + a reduce-scatter of the
    same S: 4 of each per layer, and the same bytes on the wire."""
    plain = layer_communication(model, tp, batch_size, seq_len)
    sp = layer_communication(model, tp, batch_size, seq_len, sequence_parallel=True)
    counts = _counts(sp)
    same = abs(plain.total_bytes - sp.total_bytes) <= 1e-9 * plain.total_bytes
    holds = (same and "all_reduce" not in counts and counts.get("all_gather") == 4
             and counts.get("reduce_scatter") == 4)
    return {"holds": holds, "plain_mb": plain.total_bytes / MB, "sp_mb": sp.total_bytes / MB,
            "S_mb": plain.collectives[0].nbytes / MB}


def comm_compute_ratio(model, tp, link, seq_len=4096, mfu=0.5, gpu="h100-sxm"):
    """TP communication time / compute time of one layer and micro-batch (`tp_cost`)."""
    c = tp_cost(model, tp, link=link, gpu=gpu, mfu=mfu, seq_len=seq_len)
    return {"answer": c.ratio, "comm_us": c.comm_time / US, "compute_us": c.compute_time / US,
            "link_gbs": c.link.bandwidth / GB, "link_name": c.link.name,
            "peak_tflops": c.gpu.flops("bf16") / 1e12}


def verify_tp_in_node(model, tp, seq_len=4096, mfu=0.5, gpu="h100-sxm"):
    """On NVLink 4 a layer's TP communication takes less time than its compute; over one
    InfiniBand NDR port per GPU it takes at least as long."""
    nv = tp_cost(model, tp, link="nvlink4", gpu=gpu, mfu=mfu, seq_len=seq_len)
    ib = tp_cost(model, tp, link="ib-ndr", gpu=gpu, mfu=mfu, seq_len=seq_len)
    return {"holds": nv.ratio < 1 <= ib.ratio, "nv_ratio": nv.ratio, "ib_ratio": ib.ratio,
            "nv_gbs": nv.link.bandwidth / GB, "ib_gbs": ib.link.bandwidth / GB,
            "bw_ratio": nv.link.bandwidth / ib.link.bandwidth}


def activations_tp_gb(model, seq_len, batch_size, tp, sequence_parallel=False):
    """GB of activations one layer keeps for backward on one TP rank (Korthikanti et al.)."""
    spec = get_model(model)
    kw = dict(seq_len=seq_len, batch_size=batch_size, hidden_size=spec.hidden_size,
              num_heads=spec.num_heads)
    got = activation_bytes_per_layer(tp=tp, sequence_parallel=sequence_parallel, **kw)
    one = activation_bytes_per_layer(tp=1, **kw)
    return {"answer": got / GB, "unsplit_gb": one / GB, "h": spec.hidden_size,
            "a": spec.num_heads, "sbh": seq_len * batch_size * spec.hidden_size}


def sp_activation_factor(model, seq_len, tp):
    """How many times smaller one layer's activations are with sequence parallelism than
    without, at the same tp: (10 + 24/t + 5as/(ht)) / (34/t + 5as/(ht))."""
    spec = get_model(model)
    kw = dict(seq_len=seq_len, batch_size=1, hidden_size=spec.hidden_size,
              num_heads=spec.num_heads, tp=tp)
    without = activation_bytes_per_layer(**kw)
    with_sp = activation_bytes_per_layer(sequence_parallel=True, **kw)
    return {"answer": without / with_sp, "without_gb": without / GB, "with_gb": with_sp / GB,
            "attn": 5 * spec.num_heads * seq_len / spec.hidden_size}


def verify_row_parallel_output(model, tp):
    """Megatron's attention block: QKV column-parallel (split by heads), output projection
    row-parallel, so the block needs exactly one all-reduce in the forward (the g after it);
    the layer's forward has two (attention and MLP)."""
    spec = get_model(model)
    c = layer_communication(spec, tp)
    g = c.collectives[0]                       # "g: after attention and MLP", forward
    return {"holds": g.op == "all_reduce" and g.count == 2 and spec.num_heads % tp == 0,
            "fwd": g.count, "heads_per_rank": spec.num_heads // tp}


def verify_no_gather_between(model, batch_size, seq_len, tp=2):
    """Feeding the column-parallel fc1 output to the row-parallel fc2 split (as Megatron does)
    needs no collective; gathering it first adds an all-gather of b s ffn values, ffn/h times
    the all-reduce's S."""
    spec = get_model(model)
    c = layer_communication(spec, tp, batch_size, seq_len)
    size = c.collectives[0].nbytes
    extra = batch_size * seq_len * spec.ffn_size * activation_value_bytes("bf16-mixed")
    return {"holds": extra > size, "S_mb": size / MB, "extra_mb": extra / MB,
            "ratio": extra / size, "ffn": spec.ffn_size, "h": spec.hidden_size}


def verify_all_gather_grad(tp):
    """A column-parallel layer Y_i = X A_i whose outputs are gathered by a collective that is not
    autograd-aware: the input gradient dX = sum_i dY_i A_i^T then keeps only this rank's term.
    Computed on small integer matrices: the kept term differs from the full sum, and the
    missing share is (t - 1)/t of the terms."""
    t = int(tp)
    if t < 2:
        raise ValueError(f"tp={tp!r} must be a whole number >= 2 (a gather needs two ranks)")
    # X: 1 x 2; A: 2 x t (one output column per rank); dY: 1 x t
    x_rows, cols = 2, t
    A = [[(r + 1) * (c + 2) for c in range(cols)] for r in range(x_rows)]
    dY = [c + 1 for c in range(cols)]
    full = [sum(dY[c] * A[r][c] for c in range(cols)) for r in range(x_rows)]
    local = [dY[0] * A[r][0] for r in range(x_rows)]        # rank 0's own term only
    return {"holds": full != local, "full": full, "local": local,
            "missing": (t - 1) / t}

