"""Answers of the DDP questions (labkit/quiz/data/ddp.yaml), computed with labkit.scaling
(buckets, step time, accumulation, sampler, stragglers), labkit.comm and labkit.fsdp (parameter
tensors of a preset)."""
from __future__ import annotations

import math

from labkit.comm import step_communication
from labkit.fsdp import block_shapes, root_shapes, unit_shapes
from labkit.models import get_model
from labkit.scaling import (accumulation_communication, buckets, ddp_step_time, effective_batch,
                            sampler_num_samples, straggler, throughput_loss)

GB = 1e9
MiB = 2**20


def bucket_count(model, bucket_cap_mb, grad_bytes=4):
    """DDP buckets for a preset's gradients: ceil(G / C), C = bucket_cap_mb MiB; beside it
    what torch's own rule makes (`torch_rule_buckets`) and the largest gradient tensor."""
    n = get_model(model).num_params()
    G = n * grad_bytes
    k, full, last = buckets(G, bucket_cap_mb)
    largest = max(math.prod(s) for s in ready_order(model)) * grad_bytes
    return {"answer": k, "params_m": n / 1e6, "grad_mib": G / MiB, "last_mib": last / MiB,
            "largest_mib": largest / MiB, "torch_buckets": torch_rule_buckets(model, bucket_cap_mb)}


def ready_order(model) -> list[tuple]:
    """A preset's parameter shapes in about the order the backward readies their gradients:
    the head and final norm, the blocks last to first, then the embeddings."""
    spec = get_model(model)
    root = root_shapes(spec)
    embeddings = [s for name, s in root if name.startswith("embed")]
    block = [s for _, s in block_shapes(spec)][::-1]
    return [s for name, s in root[::-1] if not name.startswith("embed")] + \
        block * spec.num_layers + embeddings[::-1]


def torch_rule_buckets(model, bucket_cap_mb) -> int:
    """Buckets torch's own assignment (dist._compute_bucket_assignment_by_size) makes of a
    preset's fp32 gradients in `ready_order`, every bucket capped at C: what torch 2.13 does once
    bucket_cap_mb is given (its 1 MiB first bucket comes only with bucket_cap_mb=None). A
    bucket closes at the tensor that fills it. Meta tensors: nothing is allocated."""
    import torch
    import torch.distributed as dist

    tensors = [torch.empty(s, device="meta") for s in ready_order(model)]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, [int(bucket_cap_mb * MiB)])
    return len(indices)


def ddp_gb_per_step(params_b, dp, grad_bytes):
    """Bytes each rank sends in one DDP step (ring all-reduce of the gradients), GB."""
    c = step_communication("ddp", num_params=params_b * 1e9, dp=dp, grad_bytes=grad_bytes)
    return {"answer": c.total_bytes / GB, "payload_gb": c.total_payload / GB,
            "factor": 2 * (dp - 1) / dp}


def ddp_step_ms(model, gpus, link, compute_s, bucket_cap_mb):
    """One DDP step (compute + the communication the backward did not hide), milliseconds."""
    r = ddp_step_time(model, gpus, link, compute_seconds=compute_s, bucket_size_mb=bucket_cap_mb)
    return {"answer": r.total * 1e3, "comm_ms": r.communication * 1e3,
            "exposed_ms": r.exposed * 1e3, "backward_ms": r.backward * 1e3,
            "buckets": r.buckets, "grad_gb": r.gradient_bytes / GB, "compute_ms": compute_s * 1e3}


def accumulation_gb(params_b, gpus, microbatches, no_sync):
    """Bytes each rank sends per optimizer step of DDP with gradient accumulation, GB."""
    c = accumulation_communication(params_b * 1e9, gpus, microbatches, no_sync=no_sync)
    once = accumulation_communication(params_b * 1e9, gpus, microbatches, no_sync=True)
    count = sum(n for n, _ in c.by_op.values())
    return {"answer": c.total_bytes / GB, "allreduces": count, "once_gb": once.total_bytes / GB}


def batch(micro_batch, microbatches, gpus):
    """Samples per optimizer step."""
    return {"answer": effective_batch(micro_batch, microbatches, gpus)}


def sampler(dataset_len, num_replicas, drop_last):
    """Samples per rank from DistributedSampler, and the padding or dropping that implies."""
    n = sampler_num_samples(dataset_len, num_replicas, drop_last)
    total = n * num_replicas
    return {"answer": n, "total": total, "padded": max(0, total - dataset_len),
            "dropped": max(0, dataset_len - total)}


def straggler_loss_pct(fast_ms, slow_ms, ranks):
    """Throughput lost when one of `ranks` ranks takes slow_ms per step and the others fast_ms, %."""
    s = straggler([fast_ms / 1e3] * (ranks - 1) + [slow_ms / 1e3])
    return {"answer": 100 * s.throughput_loss, "increase_pct": 100 * s.increase,
            "kept_pct": 100 * (1 - s.throughput_loss)}


def find_unused_overhead(model, gpus):
    """find_unused_parameters adds one all-reduce of an int32 per parameter tensor (the
    'used' bitmap): 4T bytes beside the 4 Psi of fp32 gradients."""
    T = sum(len(u) for u in unit_shapes(model))
    grads = step_communication("ddp", model=model, dp=gpus, grad_bytes=4).total_payload
    ratio = 4 * T / grads
    return {"holds": ratio < 1e-3, "tensors": T, "ratio_pct": 100 * ratio, "grad_gb": grads / GB}


def options_keep_bytes(model, gpus, bucket_cap_mb):
    """DDP's bytes per step are the gradients' ring all-reduce whatever the options: bucketing
    changes the number of calls (and gradient_as_bucket_view one copy of G in memory), not the
    bytes."""
    one = accumulation_communication(model, gpus, 1)
    bucketed = accumulation_communication(model, gpus, 1, bucket_size_mb=bucket_cap_mb)
    calls = sum(n for n, _ in bucketed.by_op.values())
    G = one.total_payload
    return {"holds": math.isclose(one.total_bytes, bucketed.total_bytes) and calls > 1,
            "calls": calls, "sent_gb": one.total_bytes / GB, "grad_gb": G / GB,
            "grad_mib": G / MiB}
