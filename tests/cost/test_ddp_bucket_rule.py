"""torch 2.13's DDP bucket limits, as the quiz (ddp-bucket-count) and lesson 03 state them: a
1 MiB first bucket only with bucket_cap_mb=None; with a cap given, every bucket's limit is it."""
from __future__ import annotations

import pytest

from labkit.quiz import get
from labkit.quiz.answers_ddp import bucket_count

MiB = 2**20


def test_first_bucket_is_small_only_with_the_default_cap():
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    default = _BucketCapacityConfig.create(None, None, False)
    assert (default.first_bucket_bytes_cap, default.bucket_bytes_cap) == (MiB, 25 * MiB)
    for cap in (25, 50, 100):
        given = _BucketCapacityConfig.create(cap, None, False)
        assert given.first_bucket_bytes_cap == given.bucket_bytes_cap == cap * MiB


@pytest.mark.parametrize("seed", range(6))
def test_bucket_count_explanation_does_not_claim_a_1_mib_first_bucket(seed):
    a = get("ddp-bucket-count").draw(seed)
    assert "first bucket 1 MiB" not in a.explanation
    assert "1 MiB first bucket only with the default, bucket_cap_mb=None" in a.explanation


def test_large_tensors_make_torch_count_fewer_buckets_than_ceil():
    """Llama-3.2-1B's MLP weights (64 MiB) and embedding (1,002 MiB) fill buckets alone."""
    r = bucket_count("llama3.2-1b", 25)
    assert (r["answer"], r["torch_buckets"], round(r["largest_mib"])) == (189, 65, 1002)
    for model in ("gpt2", "gpt2-medium", "gpt2-large", "llama3.2-1b"):
        for cap in (25, 50, 100):
            r = bucket_count(model, cap)
            # every bucket but the last holds >= C: at most floor(G / C) + 1
            assert 1 <= r["torch_buckets"] <= r["grad_mib"] // cap + 1
