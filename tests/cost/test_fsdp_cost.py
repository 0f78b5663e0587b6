"""labkit.fsdp and labkit.fsdp_migrate: FSDP2's units, per-rank bytes and collectives, computed
here independently from the shapes, and the FSDP1 -> FSDP2 table."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from labkit import fsdp_migrate
from labkit.comm import step_communication
from labkit.deepspeed import KEYS
from labkit.fsdp import fsdp_communication, fsdp_memory, unit_params, unit_shards
from labkit.models import PRESETS, get_model

# The lead's probe model: debug Llama, 2 layers, h=64, ffn 64, vocab 512 (P = 115,008)
SMALL = get_model("debug-llama").with_(num_layers=2, hidden_size=64, ffn_size=64, vocab_size=512)


def test_units_sum_to_the_model_and_follow_shard_model_order():
    for name in PRESETS:
        spec = get_model(name)
        units = unit_params(spec)
        assert sum(units) == spec.num_params(), name
        assert len(units) == spec.num_layers + 1
        assert len(set(units[spec.dense_layers:-1])) == 1      # DeepSeek-V3: 3 dense first
        assert unit_params(spec, per_block=False) == [spec.num_params()]
    # by hand: a block is q,o (h x h), k,v (h x kv), gate/up/down (3 h f), two norms (2h)
    h, kv, f, v = 64, 32, 64, 512
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert unit_params(SMALL) == [block, block, v * h + h + v * h]
    assert sum(unit_params(SMALL)) == 115_008
    # GPT-2: tied head counted once, learned positions and LayerNorm biases in the root
    g = get_model("gpt2")
    assert unit_params(g)[-1] == 50257 * 768 + 1024 * 768 + 2 * 768


def test_lead_measured_collectives_and_bytes():
    """Measured (4 ranks, SMALL): default 5 all-gathers, 3 reduce-scatters; reshard False 3
    all-gathers; per_block=False 2 and 1; bf16 params halve the all-gather bytes."""
    P = 115_008
    c = fsdp_communication(SMALL, 4)
    assert c.payload["all_gather"][0] == 5 and c.payload["reduce_scatter"] == (3, 4 * P)
    assert fsdp_communication(SMALL, 4, reshard_after_forward=False).payload["all_gather"][0] == 3
    whole = fsdp_communication(SMALL, 4, per_block=False).payload
    assert whole["all_gather"] == (2, 2 * 4 * P) and whole["reduce_scatter"] == (1, 4 * P)
    bf16 = fsdp_communication(SMALL, 4, param_dtype="bf16", reduce_dtype="fp32").payload
    assert bf16["all_gather"][1] * 2 == c.payload["all_gather"][1]
    assert bf16["reduce_scatter"] == c.payload["reduce_scatter"]
    # without padding it is exactly step_communication's model
    ref = step_communication("fsdp", model=SMALL, dp=4)
    assert c.by_op == ref.by_op and c.payload == ref.payload


def test_padding_and_int_reshard():
    # dp=3 divides no dim 0 of 64 or 32 rows: each tensor pads to ceil(d0/3) rows per rank
    spec = SMALL
    pad = unit_shards(spec, 3)
    assert pad[0] == 2 * math.ceil(64 / 3) * 64 + 2 * math.ceil(32 / 3) * 64 + \
        2 * math.ceil(64 / 3) * 64 + math.ceil(64 / 3) * 64 + 2 * math.ceil(64 / 3)
    c = fsdp_communication(spec, 3)
    assert c.payload["reduce_scatter"][1] == 4 * 3 * sum(pad) > 4 * spec.num_params()
    m = fsdp_memory(spec, 3)
    assert m.params == 4 * sum(pad) and "padding" in m.explain["params"]
    # int k: backward all-gathers over k ranks, forward over all, same payload
    k2 = fsdp_communication(spec, 4, reshard_after_forward=2)
    groups = sorted((x.why, x.group) for x in k2.collectives if x.op == "all_gather")
    assert [g for w, g in groups if w.startswith("backward")] == [2, 2]
    assert [g for w, g in groups if w == "forward"] == [4, 4, 4]
    assert k2.payload == fsdp_communication(spec, 4).payload
    assert k2.total_bytes < fsdp_communication(spec, 4).total_bytes
    assert fsdp_communication(spec, 4, reshard_after_forward=4).by_op == \
        fsdp_communication(spec, 4).by_op


def test_memory_terms_by_hand():
    """Exact terms: 4P/N params, 4P/N grads, 8P/N AdamW, 4 B per tensor of step counters
    (measured with FSDPMemTracker on 4 ranks: Sharded Param 4P/4, OptState 8P/4 + 84)."""
    spec = SMALL.with_(ffn_size=128)
    P = spec.num_params()
    m = fsdp_memory(spec, 4)
    assert (m.params, m.grads, m.optimizer_states) == (P, P, 2 * P)   # 4P/4, 4P/4, 8P/4
    assert m.steps == 4 * 21                   # 9 tensors per block x 2 + embed, norm, head
    block, root = unit_params(spec)[0] * 4, unit_params(spec)[-1] * 4
    # the lab's rule: the root stays gathered; one block at a time; prefetching adds none
    assert (m.unsharded_held, m.unsharded_peak) == (root, root + block)
    assert fsdp_memory(spec, 4, prefetch=2).unsharded_peak == root + block
    keep = fsdp_memory(spec, 4, reshard_after_forward=False)
    assert keep.unsharded_held == keep.unsharded_peak == root + 2 * block == 4 * P
    whole = fsdp_memory(spec, 4, per_block=False)
    assert (whole.unsharded_held, whole.unsharded_peak) == (0, 4 * P)
    # bf16 gathers half the bytes; the sharded fp32 states do not change
    bf = fsdp_memory(spec, 4, param_dtype="bf16")
    assert 2 * bf.unsharded_peak == m.unsharded_peak and bf.params == m.params
    assert m.total == m.model_states + m.unsharded_peak
    # offload: device states 0, the same bytes on the host
    off = fsdp_memory(spec, 4, offload=True)
    assert off.model_states == 0 and off.host == m.model_states
    assert off.total == m.total - m.model_states
    # more ranks, fewer sharded bytes per rank
    assert fsdp_memory("llama2-7b", 64).model_states < fsdp_memory("llama2-7b", 8).model_states
    assert fsdp_memory("llama2-7b", 8).model_states == pytest.approx(16 * 6_738_415_616 / 8)
    assert "params" in m.table() and "GiB" in m.table()
    assert "unsharded_peak" in m.table() and "gathered_grads" not in m.table()


def _rows(d0: int, n: int) -> int:
    """Rows of dim 0 that FSDP2 stores for a parameter on n ranks: n x ceil(d0 / n)."""
    return n * -(-d0 // n)


def test_unsharded_bytes_are_padded_and_a_1_over_k_slice_of_the_padded_output():
    """dp=4 pads the 66-row gate/up and the 514-row embedding and head; reshard_after_forward=2
    keeps half of each padded all-gather output (`_sharded_post_forward_param_data`), allocated
    while the block is whole: held = root + L x block/2, peak = root + block/2 + block + block/2
    (block 1's reshard). Computed here from the shapes."""
    h, kv, f, v, n = 64, 32, 66, 514, 4
    spec = SMALL.with_(ffn_size=f, vocab_size=v)
    block = (2 * _rows(h, n) * h + 2 * _rows(kv, n) * h + 2 * _rows(f, n) * h + _rows(h, n) * f
             + 2 * _rows(h, n))
    root = 2 * _rows(v, n) * h + _rows(h, n)
    assert block > unit_params(spec)[0] and root > unit_params(spec)[-1]      # padded
    two = fsdp_memory(spec, n, reshard_after_forward=2)
    assert two.unsharded_held == 4 * (root + 2 * (block // 2))
    assert two.unsharded_peak == 4 * (root + block // 2 + block + block // 2)
    d = fsdp_memory(spec, n)
    assert (d.unsharded_held, d.unsharded_peak) == (4 * root, 4 * (root + block))
    # one unit resharded to 2: half of it kept, the peak at its reshard is 1.5 x the model
    whole = fsdp_memory(spec, n, per_block=False, reshard_after_forward=2)
    assert (whole.unsharded_held, whole.unsharded_peak) == (2 * (2 * block + root),
                                                            6 * (2 * block + root))


@pytest.mark.parametrize("kwargs, names", [
    (dict(dp=0), "dp="), (dict(dp=2.5), "dp="), (dict(dp=4, reshard_after_forward=3),
                                                 "reshard_after_forward=3"),
    (dict(dp=4, reshard_after_forward=1), "reshard_after_forward=1"),
    (dict(dp=4, param_dtype="int8"), "param_dtype='int8'"),
    (dict(dp=4, reduce_dtype="fp64"), "reduce_dtype='fp64'"),
    (dict(dp=4, per_block="yes"), "per_block='yes'"),
])
def test_bad_input_names_the_argument(kwargs, names):
    for fn in (fsdp_memory, fsdp_communication):
        with pytest.raises(ValueError, match="allowed|must be") as exc:
            fn(SMALL, **kwargs)
        assert str(exc.value).startswith(names)
    with pytest.raises(ValueError, match=r"^prefetch=-1"):
        fsdp_memory(SMALL, 4, prefetch=-1)
    with pytest.raises(ValueError, match=r"^optimizer='lion'"):
        fsdp_memory(SMALL, 4, optimizer="lion")
    with pytest.raises(ValueError, match=r"^model='nope'"):
        fsdp_memory("nope", 4)


def test_fsdp1_table_covers_every_argument_and_strategy():
    args = {a for a, *_ in fsdp_migrate.FSDP1_TO_FSDP2}
    for needed in ("sharding_strategy", "auto_wrap_policy", "mixed_precision", "use_orig_params",
                   "backward_prefetch", "forward_prefetch", "limit_all_gathers", "cpu_offload",
                   "sync_module_states", "device_id", "ignored_modules"):
        assert needed in args
    values = " ".join(v for a, v, *_ in fsdp_migrate.FSDP1_TO_FSDP2 if a == "sharding_strategy")
    assert all(s in values for s in fsdp_migrate.STRATEGIES)
    rows = fsdp_migrate.deepspeed_zero3_rows()
    assert rows == [(k.key, k.fsdp2) for k in KEYS if 3 in k.stages] and len(rows) > 5


def test_fsdp2_equivalent_code_and_refusals():
    code = fsdp_migrate.fsdp2_equivalent("SHARD_GRAD_OP", param_dtype="bf16", cpu_offload=True)
    assert "reshard_after_forward=False" in code and "torch.bfloat16" in code
    assert "CPUOffloadPolicy()" in code and code.count("fully_shard(") == 2  # block, root
    assert "mesh=mesh" in fsdp_migrate.fsdp2_equivalent("HYBRID_SHARD", replicas=2)
    for kwargs, start in [(dict(sharding_strategy="NO_SHARD"), "sharding_strategy='NO_SHARD'"),
                          (dict(backward_prefetch="BACKWARD_POST"), "backward_prefetch="),
                          (dict(sharding_strategy="HYBRID_SHARD"), "replicas=None"),
                          (dict(replicas=2), "replicas=2"), (dict(param_dtype="int8"),
                                                             "param_dtype='int8'"),
                          (dict(sharding_strategy="ZERO3"), "sharding_strategy='ZERO3'")]:
        with pytest.raises(ValueError) as exc:
            fsdp_migrate.fsdp2_equivalent(**kwargs)
        assert str(exc.value).startswith(start), str(exc.value)


RUN = """
import os, torch, torch.distributed as dist
from torch import nn
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("socket").create_server(
    ("127.0.0.1", 0)).getsockname()[1]))
dist.init_process_group("gloo", rank=0, world_size=1)
import torch
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)); blocks = list(model)
exec(CODE)
from torch.distributed.fsdp import FSDPModule
assert all(isinstance(m, FSDPModule) for m in [model, *blocks])
model(torch.randn(2, 8)).sum().backward()
print("ran")
dist.destroy_process_group()
"""


def test_fsdp2_equivalent_runs():
    """The code written runs under torch 2.13 (one rank, CPU; CPUOffloadPolicy's default
    pin_memory=True needs a GPU, so offload is left out here)."""
    code = fsdp_migrate.fsdp2_equivalent("FULL_SHARD", param_dtype="bf16", reduce_dtype="fp32",
                                         forward_prefetch=True)
    out = subprocess.run([sys.executable, "-c", f"CODE = {code!r}\n" + RUN], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip().endswith("ran"), out.stderr[-2000:]
