"""labkit.models: exact parameter counts against transformers models built on the meta device."""
from __future__ import annotations

import subprocess
import sys

import pytest

from labkit.models import PRESETS, ModelSpec, get_model

COST_MODULES = "labkit.models, labkit.hardware, labkit.memory, labkit.flops, labkit.comm, " \
               "labkit.pipeline, labkit.cli.mem"


def meta_count(config) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_cost_models_do_not_import_torch():
    code = f"import {COST_MODULES}; import sys; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_matches_transformers_on_meta(name):
    spec = PRESETS[name]
    assert spec.num_params() == meta_count(spec.to_hf_config())


def test_published_counts():
    assert get_model("gpt2").num_params() == 124_439_808
    assert get_model("llama2-7b").num_params() == 6_738_415_616
    assert get_model("llama3-8b").num_params() == 8_030_261_248


def test_preset_shapes_are_the_public_configs():
    s = get_model("llama3-405b")
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_size,
            s.vocab_size) == (16384, 126, 128, 8, 53248, 128256)
    s = get_model("llama2-70b")
    assert (s.num_kv_heads, s.ffn_size, s.vocab_size, s.tied_embeddings) == (8, 28672, 32000,
                                                                               False)
    assert [get_model(n).hidden_size for n in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")] \
        == [768, 1024, 1280, 1600]
    assert all(get_model(n).tied_embeddings for n in ("gpt2", "gpt2-xl"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_breakdown_sums_to_total(name):
    spec = PRESETS[name]
    assert sum(spec.param_breakdown().values()) == spec.num_params()
    assert spec.num_layers * spec.params_per_layer() + spec.embedding_params() \
        + spec.final_norm_params() + spec.lm_head_params() == spec.num_params()


def test_debug_model_splits_cleanly_up_to_4():
    s = get_model("debug")
    for d in (1, 2, 4):
        for size in (s.num_heads, s.num_kv_heads, s.ffn_size, s.vocab_size, s.num_layers):
            assert size % d == 0
    assert not s.tied_embeddings and s.num_params() < 2_000_000


def test_debug_llama_is_the_debug_llama_under_its_family_name():
    """The memory lab's --model debug-llama: a Llama (RMSNorm, gated MLP, grouped-query K/V),
    the size of debug and of debug-gpt2, counted exactly like every preset (above)."""
    llama, debug, gpt2 = get_model("debug-llama"), get_model("debug"), get_model("debug-gpt2")
    assert llama.arch == "llama" and llama.gated_mlp and llama.norm == "rmsnorm"
    assert llama.num_kv_heads < llama.num_heads
    assert llama.with_(name="debug") == debug
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.vocab_size) == \
        (gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads, gpt2.vocab_size)


def test_mistral_and_qwen2_configs():
    import transformers

    mistral = transformers.MistralConfig(hidden_size=512, intermediate_size=1376,
                                         num_hidden_layers=3, num_attention_heads=8,
                                         num_key_value_heads=2, vocab_size=3000)
    qwen2 = transformers.Qwen2Config(hidden_size=512, intermediate_size=1376,
                                     num_hidden_layers=3, num_attention_heads=8,
                                     num_key_value_heads=4, vocab_size=3000,
                                     tie_word_embeddings=True)
    for cfg in (mistral, qwen2):
        spec = ModelSpec.from_hf_config(cfg)
        assert spec.num_params() == meta_count(cfg)
        assert spec.num_params() == meta_count(spec.to_hf_config())
    assert ModelSpec.from_hf_config(qwen2).qkv_bias


@pytest.mark.parametrize("kw", [
    dict(tie_word_embeddings=True),
    dict(attention_bias=True, mlp_bias=True),
    dict(num_key_value_heads=1, head_dim=48),       # head_dim * heads != hidden
])
def test_llama_variants(kw):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                   num_attention_heads=4, vocab_size=500,
                                   **{"num_key_value_heads": 2, **kw})
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.num_params() == meta_count(cfg)


def test_from_hf_config_roundtrip_and_dict():
    spec = get_model("llama3-8b")
    back = ModelSpec.from_hf_config(spec.to_hf_config(), name=spec.name)
    assert back.num_params() == spec.num_params()
    assert get_model(spec.to_hf_config().to_dict()).num_params() == spec.num_params()
    assert get_model(get_model("gpt2").to_hf_config()).num_params() == 124_439_808


@pytest.mark.parametrize("bad, match", [
    ("llama9", "not a known preset"),
    (42, "must be a preset name"),
    ({"model_type": "bert"}, "model_type='bert' is not supported"),
])
def test_bad_models(bad, match):
    with pytest.raises(ValueError, match=match):
        get_model(bad)


def test_spec_validation():
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=8"):
        get_model("debug").with_(num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers=0 must be a whole number >= 1"):
        get_model("debug").with_(num_layers=0)
