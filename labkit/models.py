"""Transformer architectures as plain numbers: `ModelSpec`, presets, exact parameter counts.

    >>> spec = get_model("llama2-7b")
    >>> spec.num_params()
    6738415616

Two families, "gpt2" (Radford et al. 2019) and "llama" (with "mistral", "qwen2": Touvron et al.
2023; Jiang et al. 2023; Qwen2 report 2024), described above `ARCHS`; presets are the public
configs on the Hugging Face Hub, and `num_params()` equals transformers' count. Pure Python (no
torch at import): the calculators recompute on every widget change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from labkit import validate

# Two families are described:
# - "gpt2": learned position embeddings, LayerNorm (weight and bias), fused QKV with biases,
#   a 4h GELU MLP with biases, LM head tied to the token embedding (Radford et al. 2019; HF
#   `GPT2LMHeadModel`).
# - "llama" (and "mistral", "qwen2", same layer shape): RoPE (no position parameters), RMSNorm
#   (weight only), grouped-query attention (kv_heads <= heads), gated SiLU MLP (gate, up,
#   down), no biases except where the architecture has them (Qwen2: q, k, v biases) (Touvron
#   et al. 2023; Jiang et al. 2023; Qwen2 technical report 2024; HF `LlamaForCausalLM` etc.).
# - mixtures of experts (`num_experts` > 0): "mixtral" (Jiang et al. 2024: Mistral's layer, every
#   MLP replaced by E SwiGLU experts, top-k routing), "qwen3_moe" (Qwen3 report 2025: q/k
#   RMSNorms, 128 experts, top-8) and "deepseek_v3" (DeepSeek-V3 report 2024: multi-head latent
#   attention (`mla`), the first `dense_layers` layers dense, then 256 routed + 1 shared
#   expert, top-8), each as transformers builds it (MixtralForCausalLM, Qwen3MoeForCausalLM,
#   DeepseekV3ForCausalLM).
ARCHS = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3")
MOE_ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")
# Each size field of a ModelSpec: a whole number from 1 to this.
_FIELD_LIMITS = {"num_layers": validate.MAX_LAYERS, "hidden_size": validate.MAX_WIDTH,
                 "num_heads": validate.MAX_WIDTH, "num_kv_heads": validate.MAX_WIDTH,
                 "ffn_size": validate.MAX_WIDTH, "vocab_size": validate.MAX_WIDTH,
                 "max_seq_len": validate.MAX_SEQ_LEN}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. Sizes are counts (not bytes).

    `ffn_size` is the MLP's inner width (GPT-2: 4 * hidden; Llama: intermediate_size).
    `qkv_bias` / `out_bias` / `mlp_bias`: whether those projections carry biases.
    """

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    max_seq_len: int
    head_dim: int | None = None          # None: hidden_size // num_heads
    gated_mlp: bool = True
    tied_embeddings: bool = False
    norm: str = "rmsnorm"                # "rmsnorm" (weight) | "layernorm" (weight + bias)
    learned_positions: bool = False      # GPT-2's wpe table
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    extra: tuple = ()                    # extra HF config fields (key, value) for to_hf_config()
    # mixture of experts (0: a dense model): routed experts, experts per token (k), each
    # expert's inner width (None: ffn_size), shared experts (always on, DeepSeek), the first
    # layers that keep a dense MLP of ffn_size (DeepSeek-V3: 3)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_size: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    qk_norm: bool = False                # Qwen3: RMSNorm over each head's q and k
    # multi-head latent attention (DeepSeek-V2/V3): (q_lora_rank (0: no q compression),
    # kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim); () for ordinary attention
    mla: tuple = ()

    def __post_init__(self):
        validate.choice("arch", self.arch, ARCHS)
        validate.choice("norm", self.norm, ("rmsnorm", "layernorm"))
        for field, at_most in _FIELD_LIMITS.items():
            validate.positive_int(field, getattr(self, field), at_most)
        self._check_moe()
        validate.divides("num_kv_heads", self.num_kv_heads, "num_heads", self.num_heads)
        if self.head_dim is None:
            validate.divides("num_heads", self.num_heads, "hidden_size", self.hidden_size)
        else:
            validate.positive_int("head_dim", self.head_dim, validate.MAX_WIDTH)
        n = self.num_params()
        if n > validate.MAX_PARAMS:
            raise ValueError(
                f"ModelSpec {self.name!r} has {validate.show(n)} parameters (num_layers="
                f"{self.num_layers}, hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, "
                f"vocab_size={self.vocab_size}); allowed: at most "
                f"{validate.show(validate.MAX_PARAMS)}")

    # ---- shapes -------------------------------------------------------------------------
    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (num_heads * head_dim)."""
        return self.num_heads * self.d_head

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections' outputs (num_kv_heads * head_dim);
        with MLA the up-projected keys (heads x (nope + rope))."""
        if self.mla:
            return self.num_heads * (self.mla[2] + self.mla[3])
        return self.num_kv_heads * self.d_head

    @property
    def score_width(self) -> float:
        """heads x the mean of the q.k and v head widths: what the attention scores and their
        product with V cost per key, 2 x this FLOPs each (q_size without MLA, whose q.k heads
        are nope + rope wide and v heads v_head_dim)."""
        if self.mla:
            return self.num_heads * (self.mla[2] + self.mla[3] + self.mla[4]) / 2
        return float(self.q_size)

    # ---- mixture of experts -----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        """One expert's inner width (moe_intermediate_size)."""
        return self.expert_ffn_size or self.ffn_size

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.is_moe else 0

    def expert_params(self) -> int:
        """Parameters of one routed expert (a SwiGLU MLP: gate, up, down)."""
        return 3 * self.hidden_size * self.expert_ffn

    def _check_moe(self):
        if not self.is_moe:
            if self.experts_per_token or self.shared_experts or self.dense_layers:
                raise ValueError(f"ModelSpec {self.name!r}: experts_per_token, shared_experts "
                                 "and dense_layers need num_experts >= 1; allowed: 0 for a "
                                 "dense model")
            return
        validate.positive_int("num_experts", self.num_experts, validate.MAX_WIDTH)
        validate.positive_int("experts_per_token", self.experts_per_token, self.num_experts)
        if self.expert_ffn_size is not None:
            validate.positive_int("expert_ffn_size", self.expert_ffn_size, validate.MAX_WIDTH)
        if not 0 <= self.shared_experts <= validate.MAX_WIDTH:
            raise ValueError(f"shared_experts={self.shared_experts!r}; allowed: 0 or more")
        if not 0 <= self.dense_layers < self.num_layers:
            raise ValueError(f"dense_layers={self.dense_layers!r}; allowed: 0 to "
                             f"{self.num_layers - 1} (num_layers - 1)")
        if not self.gated_mlp or self.mlp_bias:
            raise ValueError("an MoE ModelSpec has SwiGLU experts without biases; allowed: "
                             "gated_mlp=True, mlp_bias=False")
        if self.mla and (len(self.mla) != 5 or not all(isinstance(x, int) and x >= 0
                                                        for x in self.mla)):
            raise ValueError(f"mla={self.mla!r}; allowed: () or (q_lora_rank, kv_lora_rank, "
                             "qk_nope_head_dim, qk_rope_head_dim, v_head_dim), whole numbers")

    # ---- parameter counts ---------------------------------------------------------------
    def layer_parts(self, dense: bool = False) -> dict[str, int]:
        """Parameters of one transformer layer, split by how tensor parallelism treats them.

        - "attention_sharded": q, k, v, o weights and the column-parallel (q, k, v) biases;
        - "mlp_sharded": MLP weights and the column-parallel (fc / gate / up) biases;
        - "replicated": norms and the row-parallel biases (o, down), identical on every TP rank
          (Shoeybi et al. 2019, Megatron-LM §3: the bias of a row-parallel layer is added
          after the all-reduce).
        A mixture-of-experts layer (`dense=False`, the default for an MoE spec) also has
        "experts": its routed experts, which expert parallelism splits; "mlp_sharded" is then
        its shared experts, and the router (hidden x num_experts) is "replicated". `dense=True`:
        one of an MoE model's first `dense_layers` (a dense MLP of ffn_size).
        """
        h, q, kv, f = self.hidden_size, self.q_size, self.kv_size, self.ffn_size
        if self.mla:
            q_lora, kv_lora, nope, rope, v = self.mla
            qk = self.num_heads * (nope + rope)
            attn = ((h * q_lora + q_lora * qk) if q_lora else h * qk) \
                + h * (kv_lora + rope) + kv_lora * self.num_heads * (nope + v) \
                + self.num_heads * v * h
        else:
            attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        n_in = 2 if self.gated_mlp else 1                 # gate and up, or fc
        moe = self.is_moe and not dense
        mlp = (self.shared_experts * self.expert_params() if moe else n_in * h * f + f * h)
        if self.mlp_bias:
            mlp += n_in * f
        norm = 2 * h if self.norm == "layernorm" else h   # LayerNorm: weight + bias
        replicated = 2 * norm                             # pre-attention and pre-MLP norms
        if self.out_bias:
            replicated += h
        if self.mlp_bias:
            replicated += h
        if self.qk_norm:
            replicated += 2 * self.d_head
        if self.mla:                                      # the two latent RMSNorms
            replicated += self.mla[0] + self.mla[1]
        out = {"attention_sharded": attn, "mlp_sharded": mlp, "replicated": replicated}
        if moe:
            out["replicated"] += h * self.num_experts     # the router
            out["experts"] = self.num_experts * self.expert_params()
        return out

    def params_per_layer(self) -> float:
        """Parameters of the average transformer layer (an MoE model's layers differ: its
        dense layers and its MoE layers; the mean keeps L x this exact)."""
        if not self.dense_layers:
            return sum(self.layer_parts().values())
        return (self.dense_layers * sum(self.layer_parts(dense=True).values())
                + self.moe_layers * sum(self.layer_parts().values())) / self.num_layers

    def active_params(self) -> int:
        """Parameters one token uses: every parameter except the routed experts it is not
        sent to (k of num_experts per MoE layer). Equal to num_params() for a dense model."""
        if not self.is_moe:
            return self.num_params()
        idle = self.num_experts - self.experts_per_token
        return self.num_params() - self.moe_layers * idle * self.expert_params()

    def embedding_params(self) -> int:
        """Token embedding (vocab x hidden) plus learned position embeddings if any."""
        n = self.vocab_size * self.hidden_size
        if self.learned_positions:
            n += self.max_seq_len * self.hidden_size
        return n

    def final_norm_params(self) -> int:
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    def lm_head_params(self) -> int:
        """Separate output projection; 0 when tied to the token embedding (one shared tensor)."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    def param_breakdown(self) -> dict[str, int]:
        """Exact parameter count by component; the values sum to `num_params()`."""
        L = self.num_layers
        parts = self.layer_parts()
        h = self.hidden_size
        norm = 2 * h if self.norm == "layernorm" else h
        attn = parts["attention_sharded"] + (h if self.out_bias else 0)
        mlp = parts["mlp_sharded"] + (h if self.mlp_bias else 0)
        norms = 2 * norm + (2 * self.d_head if self.qk_norm else 0) + (
            self.mla[0] + self.mla[1] if self.mla else 0)
        out = {
            "embeddings": self.embedding_params(),
            "attention": L * attn,
            "mlp": L * mlp,
            "norms": L * norms + self.final_norm_params(),
            "lm_head": self.lm_head_params(),
        }
        if self.is_moe:
            dense = self.layer_parts(dense=True)["mlp_sharded"]
            out["mlp"] = self.dense_layers * dense + self.moe_layers * parts["mlp_sharded"]
            out["router"] = self.moe_layers * h * self.num_experts
            out["experts"] = self.moe_layers * parts["experts"]
        return out

    def num_params(self) -> int:
        """Exact number of parameters (tied embeddings counted once).

        Equals `sum(p.numel() for p in model.parameters())` of the transformers model built
        from `self.to_hf_config()` (tests check every preset on the meta device). Tied
        embeddings are one tensor, counted once, exactly as `model.parameters()` yields them
        once."""
        return sum(self.param_breakdown().values())

    def non_embedding_params(self) -> int:
        """Parameters outside the embedding tables and the LM head (Kaplan et al. 2020's N)."""
        return self.num_params() - self.embedding_params() - self.lm_head_params()

    # ---- transformers interop -----------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> "ModelSpec":
        """Read a transformers config (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, or a
        dict with the same fields, including `model_type`)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        model_type = get("model_type")
        name = name or get("_name_or_path") or model_type or "custom"
        if model_type == "gpt2":
            h = get("n_embd")
            return cls(
                name=name, arch="gpt2", num_layers=get("n_layer"), hidden_size=h,
                num_heads=get("n_head"), num_kv_heads=get("n_head"),
                ffn_size=get("n_inner") or 4 * h, vocab_size=get("vocab_size"),
                max_seq_len=get("n_positions"), gated_mlp=False,
                tied_embeddings=bool(get("tie_word_embeddings", True)), norm="layernorm",
                learned_positions=True, qkv_bias=True, out_bias=True, mlp_bias=True,
            )
        if model_type in ("llama", "mistral", "qwen2"):
            heads = get("num_attention_heads")
            h = get("hidden_size")
            head_dim = get("head_dim") or h // heads
            bias = bool(get("attention_bias", False))
            return cls(
                name=name, arch=model_type, num_layers=get("num_hidden_layers"), hidden_size=h,
                num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
                ffn_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                max_seq_len=get("max_position_embeddings"),
                head_dim=None if head_dim * heads == h else head_dim,
                gated_mlp=True, tied_embeddings=bool(get("tie_word_embeddings", False)),
                norm="rmsnorm",
                # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias covers
                # all four projections.
                qkv_bias=True if model_type == "qwen2" else bias,
                out_bias=bias if model_type == "llama" else False,
                mlp_bias=bool(get("mlp_bias", False)) if model_type == "llama" else False,
            )
        if model_type in MOE_ARCHS:
            return _moe_from_hf(cls, get, model_type, name)
        allowed = ", ".join(repr(a) for a in ARCHS)
        raise ValueError(f"config.model_type={model_type!r} is not supported; allowed: {allowed}")

    def to_hf_config(self, **overrides):
        """The matching transformers config (imports transformers, lazily)."""
        import transformers

        if self.arch == "gpt2":
            kw = dict(vocab_size=self.vocab_size, n_positions=self.max_seq_len,
                      n_embd=self.hidden_size, n_layer=self.num_layers, n_head=self.num_heads,
                      n_inner=None if self.ffn_size == 4 * self.hidden_size else self.ffn_size,
                      tie_word_embeddings=self.tied_embeddings,
                      # GPT-2's <|endoftext|> is the last token; keep it inside small vocabularies.
                      bos_token_id=self.vocab_size - 1, eos_token_id=self.vocab_size - 1)
            cls = transformers.GPT2Config
        else:
            kw = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      intermediate_size=self.ffn_size, num_hidden_layers=self.num_layers,
                      num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                      head_dim=self.d_head, max_position_embeddings=self.max_seq_len,
                      tie_word_embeddings=self.tied_embeddings)
            if self.arch == "llama":
                kw.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
            if self.is_moe:
                kw.update(_moe_to_hf(self))
            cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                   "qwen2": transformers.Qwen2Config, "mixtral": transformers.MixtralConfig,
                   "qwen3_moe": transformers.Qwen3MoeConfig,
                   "deepseek_v3": transformers.DeepseekV3Config}[self.arch]
        kw.update(dict(self.extra))
        kw.update(overrides)
        return cls(**kw)

    def with_(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _moe_from_hf(cls, get, model_type, name) -> "ModelSpec":
    """Mixtral, Qwen3-MoE and DeepSeek-V3 configs; what ModelSpec cannot count exactly is a
    ValueError naming the field."""
    heads, h = get("num_attention_heads"), get("hidden_size")
    common = dict(name=name, arch=model_type, num_layers=get("num_hidden_layers"), hidden_size=h,
                  num_heads=heads, vocab_size=get("vocab_size"),
                  max_seq_len=get("max_position_embeddings"), gated_mlp=True, norm="rmsnorm",
                  tied_embeddings=bool(get("tie_word_embeddings", False)),
                  experts_per_token=get("num_experts_per_tok"))
    if model_type == "mixtral":
        head_dim = get("head_dim") or h // heads
        return cls(**common, num_kv_heads=get("num_key_value_heads") or heads,
                   ffn_size=get("intermediate_size"),
                   head_dim=None if head_dim * heads == h else head_dim,
                   num_experts=get("num_local_experts"))
    if get("attention_bias", False):
        raise ValueError(f"config.attention_bias=True is not supported for {model_type}; "
                         "allowed: False (as the released models)")
    if model_type == "qwen3_moe":
        if get("decoder_sparse_step", 1) != 1 or list(get("mlp_only_layers") or []):
            raise ValueError("config.decoder_sparse_step != 1 or mlp_only_layers: dense layers "
                             "between MoE layers are not supported; allowed: "
                             "decoder_sparse_step=1, mlp_only_layers=[] (as Qwen3-MoE ships)")
        head_dim = get("head_dim") or h // heads
        return cls(**common, num_kv_heads=get("num_key_value_heads") or heads,
                   ffn_size=get("intermediate_size"), expert_ffn_size=get("moe_intermediate_size"),
                   head_dim=None if head_dim * heads == h else head_dim, qk_norm=True,
                   num_experts=get("num_experts"))
    nope, rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    return cls(**common, num_kv_heads=heads, ffn_size=get("intermediate_size"),
               expert_ffn_size=get("moe_intermediate_size"), head_dim=nope + rope,
               num_experts=get("n_routed_experts"), shared_experts=get("n_shared_experts") or 0,
               dense_layers=get("first_k_dense_replace") or 0,
               mla=(get("q_lora_rank") or 0, get("kv_lora_rank"), nope, rope,
                    get("v_head_dim")))


def _moe_to_hf(spec) -> dict:
    if spec.arch == "mixtral":
        return dict(num_local_experts=spec.num_experts,
                    num_experts_per_tok=spec.experts_per_token)
    if spec.arch == "qwen3_moe":
        return dict(num_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                    moe_intermediate_size=spec.expert_ffn, decoder_sparse_step=1,
                    mlp_only_layers=[], attention_bias=False)
    q_lora, kv_lora, nope, rope, v = spec.mla
    # DeepSeek's group-limited routing: groups must divide the experts (1 group on small ones)
    groups = 8 if spec.num_experts % 8 == 0 and spec.num_experts >= 64 else 1
    return dict(n_routed_experts=spec.num_experts, num_experts_per_tok=spec.experts_per_token,
                moe_intermediate_size=spec.expert_ffn, n_shared_experts=spec.shared_experts,
                first_k_dense_replace=spec.dense_layers, q_lora_rank=q_lora or None,
                kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                v_head_dim=v, head_dim=rope, num_key_value_heads=spec.num_heads,
                n_group=groups, topk_group=min(4, groups))


# ---- presets ---------------------------------------------------------------------------
# Values are the public configs (config.json on the Hugging Face Hub for each model).

def _gpt2(name, h, layers, heads):
    return ModelSpec(name=name, arch="gpt2", num_layers=layers, hidden_size=h, num_heads=heads,
                     num_kv_heads=heads, ffn_size=4 * h, vocab_size=50257, max_seq_len=1024,
                     gated_mlp=False, tied_embeddings=True, norm="layernorm",
                     learned_positions=True, qkv_bias=True, out_bias=True, mlp_bias=True)


def _llama(name, h, layers, heads, kv, ffn, vocab, seq, **extra):
    return ModelSpec(name=name, arch="llama", num_layers=layers, hidden_size=h, num_heads=heads,
                     num_kv_heads=kv, ffn_size=ffn, vocab_size=vocab, max_seq_len=seq,
                     extra=tuple(sorted(extra.items())))


def _megatron(name, h, layers, heads, vocab=51200):
    # Megatron-LM's GPT (Narayanan et al. 2021, Table 1: vocabulary 51,200, sequence 2,048):
    # GPT-2's layer (LayerNorm, biases, 4h GELU MLP), learned positions, tied embeddings.
    return _gpt2(name, h, layers, heads).with_(vocab_size=vocab, max_seq_len=2048)


PRESETS: dict[str, ModelSpec] = {
    "gpt2": _gpt2("gpt2", 768, 12, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 1024, 24, 16),
    "gpt2-large": _gpt2("gpt2-large", 1280, 36, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 1600, 48, 25),
    "llama2-7b": _llama("llama2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, rms_norm_eps=1e-5),
    "llama2-13b": _llama("llama2-13b", 5120, 40, 40, 40, 13824, 32000, 4096, rms_norm_eps=1e-5),
    "llama2-70b": _llama("llama2-70b", 8192, 80, 64, 8, 28672, 32000, 4096, rms_norm_eps=1e-5),
    "llama3-8b": _llama("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192,
                        rms_norm_eps=1e-5, rope_theta=500000.0),
    "llama3-70b": _llama("llama3-70b", 8192, 80, 64, 8, 28672, 128256, 8192,
                         rms_norm_eps=1e-5, rope_theta=500000.0),
    # Llama 3.1 405B (the only released 405B); RoPE scaling does not change the count.
    "llama3-405b": _llama("llama3-405b", 16384, 126, 128, 8, 53248, 128256, 131072,
                          rms_norm_eps=1e-5, rope_theta=500000.0),
    # Llama 3.2 1B (Meta's config.json): tied embeddings, 16 layers.
    "llama3.2-1b": _llama("llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, 131072,
                          rms_norm_eps=1e-5, rope_theta=500000.0).with_(tied_embeddings=True),
    # GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12,288, 96 heads of 128,
    # context 2,048; GPT-2's tokenizer, 50,257 tokens): 174.6B parameters.
    "gpt3-175b": _megatron("gpt3-175b", 12288, 96, 96, vocab=50257),
    # Narayanan et al. 2021, Table 1 rows (the paper's 310.1B and 1008.0B)
    "megatron-310b": _megatron("megatron-310b", 16384, 96, 128),
    "megatron-1t": _megatron("megatron-1t", 25600, 128, 160),
    # Tiny Llama-style model the labs train on CPU in about a second. Every size is divisible by
    # 1, 2 and 4 (heads 8, kv heads 4, ffn 256, vocab 1024, layers 4), so each parallel degree
    # up to 4 splits it cleanly; untied embeddings so the LM head is its own tensor.
    "debug": _llama("debug", 128, 4, 8, 4, 256, 1024, 256),
    # The same tiny Llama under its family's name, beside debug-gpt2 (the memory lab's --model).
    "debug-llama": _llama("debug-llama", 128, 4, 8, 4, 256, 1024, 256),
    # The same size as GPT-2 (LayerNorm, biases, tied embeddings, learned positions).
    "debug-gpt2": ModelSpec(name="debug-gpt2", arch="gpt2", num_layers=4, hidden_size=128,
                            num_heads=8, num_kv_heads=8, ffn_size=512, vocab_size=1024,
                            max_seq_len=256, gated_mlp=False, tied_embeddings=True,
                            norm="layernorm", learned_positions=True, qkv_bias=True,
                            out_bias=True, mlp_bias=True),
}


# Mixtures of experts (each config.json on the Hugging Face Hub):
# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): Mistral 7B's layer, 8 experts, top-2.
PRESETS["mixtral-8x7b"] = ModelSpec(
    name="mixtral-8x7b", arch="mixtral", num_layers=32, hidden_size=4096, num_heads=32,
    num_kv_heads=8, ffn_size=14336, vocab_size=32000, max_seq_len=32768, num_experts=8,
    experts_per_token=2, extra=(("rms_norm_eps", 1e-5), ("rope_theta", 1e6)))
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): 48 layers, heads 32 x 128 (wider than hidden), 4 KV heads,
# 128 experts of 768, top-8, q/k norms.
PRESETS["qwen3-30b-a3b"] = ModelSpec(
    name="qwen3-30b-a3b", arch="qwen3_moe", num_layers=48, hidden_size=2048, num_heads=32,
    num_kv_heads=4, ffn_size=6144, vocab_size=151936, max_seq_len=40960, head_dim=128,
    num_experts=128, experts_per_token=8, expert_ffn_size=768, qk_norm=True,
    extra=(("norm_topk_prob", True), ("rms_norm_eps", 1e-6), ("rope_theta", 1e6)))
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3, transformers' DeepseekV3Config defaults): 61 layers,
# the first 3 dense (18,432), then 256 routed experts of 2,048 + 1 shared, top-8; MLA (q rank
# 1,536, kv rank 512, heads of 128 + 64 rope, v 128). Pre-trained at 4,096 tokens (the context
# was extended later). transformers builds no multi-token-prediction module (14B more on the
# Hub): 671B, of which 37B active per token.
PRESETS["deepseek-v3"] = ModelSpec(
    name="deepseek-v3", arch="deepseek_v3", num_layers=61, hidden_size=7168, num_heads=128,
    num_kv_heads=128, ffn_size=18432, vocab_size=129280, max_seq_len=4096, head_dim=192,
    num_experts=256, experts_per_token=8, expert_ffn_size=2048, shared_experts=1,
    dense_layers=3, mla=(1536, 512, 128, 64, 128))
# A tiny Mixtral the MoE lab trains on CPU: 8 experts, top-2, every size divisible by 1, 2, 4.
PRESETS["debug-moe"] = ModelSpec(
    name="debug-moe", arch="mixtral", num_layers=2, hidden_size=128, num_heads=8,
    num_kv_heads=4, ffn_size=256, vocab_size=1024, max_seq_len=256, num_experts=8,
    experts_per_token=2)


# BLOOM-176B (BigScience 2022; bigscience/bloom config.json: 70 layers, hidden 14,336, 112
# heads, vocabulary 250,880, trained at sequence 2,048): GPT-2's layer, but ALiBi (no position
# table) and a LayerNorm after the embedding. Not a preset: transformers builds it as BloomModel,
# which ModelSpec does not map; as a GPT-2 shape without positions it leaves out only that
# embedding LayerNorm's 2 h = 28,672 parameters (of 176.2B).
BLOOM_176B = _gpt2("bloom-176b", 14336, 70, 112).with_(vocab_size=250880, max_seq_len=2048,
                                                       learned_positions=False)


def get_model(model) -> ModelSpec:
    """A `ModelSpec` from a preset name, a ModelSpec, or a transformers config (or its dict)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        key = model.lower()
        if key not in PRESETS:
            allowed = ", ".join(PRESETS)
            raise ValueError(f"model={model!r} is not a known preset; allowed: {allowed} "
                             "(or pass a ModelSpec or a transformers config)")
        return PRESETS[key]
    if isinstance(model, dict) or hasattr(model, "model_type"):
        return ModelSpec.from_hf_config(model)
    raise ValueError(f"model={model!r} must be a preset name, a ModelSpec or a transformers "
                     "config")
