"""Mixture-of-experts cost models: exact parameter counts against transformers, expert states
over ep, activations with k x capacity, FLOPs from active parameters, EP's all-to-all."""
from __future__ import annotations

import pytest

from labkit.comm import collective_time, step_communication
from labkit.flops import flops_per_token
from labkit.hardware import get_link
from labkit.memory import estimate_memory
from labkit.models import PRESETS, ModelSpec, get_model

MOE = [n for n, s in PRESETS.items() if s.is_moe]


@pytest.mark.parametrize("name", MOE)
def test_total_params_equal_transformers_on_the_meta_device(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = get_model(name)
    config = spec.to_hf_config()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    back = ModelSpec.from_hf_config(config, name=name)
    assert back.num_params() == spec.num_params() and back.active_params() == spec.active_params()


def test_active_params_are_the_published_figures():
    # Mixtral 8x7B: 46.7B total, 12.9B active (Jiang et al. 2024); Qwen3-30B-A3B: 30.5B / 3.3B;
    # DeepSeek-V3: 671B / 37B (its report, without the 14B multi-token-prediction module)
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                ("deepseek-v3", 671e9, 37e9)):
        spec = get_model(name)
        assert spec.num_params() == pytest.approx(total, rel=0.005), name
        assert spec.active_params() == pytest.approx(active, rel=0.02), name
    m = get_model("mixtral-8x7b")       # by hand: 6 of 8 experts idle in each of 32 layers
    assert m.num_params() - m.active_params() == 32 * 6 * 3 * 4096 * 14336
    dense = get_model("llama3-8b")
    assert dense.active_params() == dense.num_params() and not dense.is_moe


def test_what_modelspec_cannot_count_is_an_error():
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(Qwen3MoeConfig(mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelSpec.from_hf_config(DeepseekV3Config(attention_bias=True))
    with pytest.raises(ValueError, match="experts_per_token"):
        get_model("debug-moe").with_(experts_per_token=9)
    with pytest.raises(ValueError, match="num_experts"):
        get_model("debug").with_(experts_per_token=2)


def test_expert_states_divide_over_ep_and_shard_over_edp():
    spec = get_model("mixtral-8x7b")
    experts = 32 * spec.num_experts * spec.expert_params()
    dense = spec.num_params() - experts
    one, ep8 = (estimate_memory(spec, seq_len=4096, dp=8, ep=e) for e in (1, 8))
    assert one.params == pytest.approx(2 * spec.num_params())
    assert ep8.params == pytest.approx(2 * (dense + experts / 8))
    # ZeRO-1 over dp = 8 with ep = 8: the dense optimizer states / 8, the experts' / edp = 1
    z = estimate_memory(spec, seq_len=4096, dp=8, ep=8, zero_stage=1)
    assert z.optimizer_states == pytest.approx(12 * (dense / 8 + experts / 8))
    z2 = estimate_memory(spec, seq_len=4096, dp=16, ep=8, zero_stage=1)      # edp = 2
    assert z2.optimizer_states == pytest.approx(12 * (dense / 16 + experts / 8 / 2))
    for kw, message in ((dict(model="llama3-8b", ep=2), "mixture-of-experts"),
                        (dict(model=spec, ep=16, dp=16), "does not divide num_experts"),
                        (dict(model=spec, ep=4, dp=2), "must divide tp x dp")):
        with pytest.raises(ValueError, match=message):
            estimate_memory(**kw)


def test_moe_activations_grow_with_k_and_the_capacity_factor():
    spec = get_model("mixtral-8x7b")
    kw = dict(seq_len=4096, dp=8, ep=8, implementation="fused")
    exact, padded = (estimate_memory(spec, capacity_factor=c, **kw).activations
                     for c in (None, 1.25))
    top1 = estimate_memory(spec.with_(experts_per_token=1), **kw).activations
    assert top1 < exact < padded
    full = estimate_memory(spec, recompute="full", **kw).activations
    assert full == estimate_memory(spec.with_(experts_per_token=1), recompute="full",
                                   **kw).activations          # only the layer inputs


def test_moe_flops_count_active_parameters():
    spec = get_model("deepseek-v3")
    s = 4096
    head_and_layers = spec.active_params() - spec.embedding_params()
    # MLA: q.k over 128 + 64 per head, v over 128
    attn = 4 * spec.num_layers * spec.num_heads * (128 + 64 + 128) / 2 * s
    assert flops_per_token(spec, s) == pytest.approx(6 * head_and_layers + 3 * attn)
    dense_equivalent = flops_per_token(spec.with_(experts_per_token=spec.num_experts), s)
    assert flops_per_token(spec, s) < dense_equivalent / 5


def test_ep_all_to_all_by_hand_and_on_each_link():
    spec = get_model("mixtral-8x7b")
    c = step_communication("ep", spec, ep=8, seq_len=4096, microbatches=2, batch_size=1)
    (a2a,) = c.collectives
    assert a2a.op == "all_to_all" and a2a.group == 8
    assert a2a.count == 4 * 32 * 2                       # 4 per MoE layer and micro-batch
    assert a2a.nbytes == 4096 * 2 * 4096 * 2             # tokens x k x h x bf16
    full = step_communication("ep", spec, ep=8, seq_len=4096, recompute="full").collectives[0]
    assert full.count == 6 * 32
    cf = step_communication("ep", spec, ep=8, seq_len=4096, capacity_factor=1.25).collectives[0]
    assert cf.nbytes == pytest.approx(1.25 * a2a.nbytes)
    sp = step_communication("ep", spec, ep=8, tp=2, sequence_parallel=True,
                            seq_len=4096).collectives[0]
    assert sp.nbytes == a2a.nbytes / 2
    nvlink, ib = (collective_time("all_to_all", a2a.nbytes, 8, get_link(k).bandwidth,
                                  get_link(k).latency) for k in ("nvlink4", "ib-ndr"))
    assert ib > 5 * nvlink
    assert step_communication("ep", spec, ep=1, seq_len=4096).collectives == []
    with pytest.raises(ValueError, match="dense"):
        step_communication("ep", "llama3-8b", ep=2)


def test_the_planner_prices_an_ep_axis():
    from labkit.kernels import layer_seconds
    from labkit.planner import Layout, degree_problem, evaluate, parse_layout, plan

    lay = Layout(dp=64, ep=8, sharding="fsdp")
    assert "ep=8" in str(lay) and parse_layout(str(lay)) == lay
    kw = dict(gpu="h100-sxm", global_batch=512, seq_len=4096)
    inside, across = (evaluate("mixtral-8x7b", Layout(dp=64, ep=e, sharding="fsdp"), **kw)
                      for e in (8, 2))
    assert "NVLink" in inside.links["ep"] and inside.breakdown["ep"] > 0
    # experts split 8 ways hold less than split 2 ways (their states shard over edp = 64 / ep
    # either way under FSDP, so compare without sharding)
    a, b = (evaluate("mixtral-8x7b", Layout(dp=8, ep=e), **{**kw, "global_batch": 64})
            for e in (2, 8))
    assert b.memory < a.memory
    # DeepSeek-V3's experts across nodes: the all-to-all on InfiniBand
    wide = evaluate("deepseek-v3", Layout(pp=16, dp=128, ep=64, sharding="zero1"),
                    global_batch=4096, seq_len=4096)
    assert "InfiniBand" in wide.links["ep"] and wide.breakdown["ep"] > 1.0
    # more experts per rank: each expert's GEMMs see fewer tokens, and run slower per FLOP
    few, many = (layer_seconds("deepseek-v3", "h100-sxm", tokens=4096, seq_len=4096, ep=e)
                 for e in (64, 1))
    assert many.matmul > few.matmul
    assert degree_problem(get_model("llama3-8b"), Layout(dp=8, ep=2), 8, 4096).startswith("ep")
    assert "does not divide num_experts" in degree_problem(
        get_model("mixtral-8x7b"), Layout(dp=16, ep=16), 8, 4096)
    p = plan("mixtral-8x7b", 16, **{**kw, "global_batch": 64})
    assert {e.layout.ep for e in p.ranked} >= {1, 2, 4, 8} and p.best.layout.ep > 1
    assert all(e.layout.ep == 1 for e in plan("llama3-8b", 8, **{**kw, "global_batch": 64}).ranked)
