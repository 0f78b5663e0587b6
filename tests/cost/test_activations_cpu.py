"""What a learner's CPU keeps for backward, against labkit's prediction for device="cpu".

torch's kernels differ by device: on a CPU, `F.dropout` is the composite kernel (its random
mask is a tensor of the activation's dtype, not CUDA's 1-byte mask), and SDPA with dropout has
no fused kernel: it falls back to the math path (fp32 Q, K, V and scores). The models run here
as shipped, no kernel swapped (tests/cost/test_activations.py checks the CUDA prediction with
CUDA's dropout kernel swapped in), on shapes that test does not use.
"""
from __future__ import annotations

import contextlib

import pytest

from labkit.memory import activation_bytes_per_layer, estimate_memory
from labkit.models import get_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from labkit.labs.common.models import fused_dropout  # noqa: E402
from labkit.runtime.measure import SavedActivations  # noqa: E402

transformers.logging.set_verbosity_error()
DTYPES = {"bf16-mixed": torch.bfloat16, "fp32": torch.float32}
# (arch, hidden, heads, kv heads, ffn, seq, batch)
SHAPES = [("gpt2", 96, 3, 3, 384, 40, 3), ("gpt2", 160, 5, 5, 640, 24, 1),
          ("llama", 96, 6, 2, 256, 40, 3), ("llama", 160, 5, 5, 432, 24, 1)]


def _spec(arch, h, a, kv, ffn, layers):
    base = get_model("debug-gpt2" if arch == "gpt2" else "debug")
    return base.with_(name="t", hidden_size=h, num_heads=a, num_kv_heads=kv, ffn_size=ffn,
                      num_layers=layers, vocab_size=96)


def _saved(spec, attention, precision, dropout, s, b, fused=False) -> int:
    torch.manual_seed(0)
    p = 0.1 if dropout else 0.0
    if spec.arch == "gpt2":
        config = spec.to_hf_config(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
        cls = transformers.GPT2LMHeadModel
    else:
        config = spec.to_hf_config(attention_dropout=p)
        cls = transformers.LlamaForCausalLM
    model = cls._from_config(config, attn_implementation=attention).to(DTYPES[precision]).train()
    ids = torch.randint(0, spec.vocab_size, (b, s))
    with fused_dropout() if fused else contextlib.nullcontext():
        with SavedActivations(model) as saved:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return saved.bytes


@pytest.mark.parametrize("shape", SHAPES, ids=lambda x: "{}-h{}a{}kv{}f{}s{}b{}".format(*x))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("dropout", [True, False], ids=["dropout", "no-dropout"])
def test_cpu_prediction_matches_a_cpu_run(shape, attention, dropout):
    arch, h, a, kv, ffn, s, b = shape
    impl = "hf-gpt2" if arch == "gpt2" else "hf-llama"
    for precision in DTYPES:
        one, two = (_saved(_spec(arch, h, a, kv, ffn, n), attention, precision, dropout, s, b)
                    for n in (1, 2))
        layer = activation_bytes_per_layer(s, b, h, a, implementation=impl, attention=attention,
                                           num_kv_heads=kv, ffn_size=ffn, precision=precision,
                                           dropout=dropout, device="cpu")
        whole = estimate_memory(_spec(arch, h, a, kv, ffn, 2), batch_size=b, seq_len=s,
                                precision=precision, attention=attention, dropout=dropout,
                                device="cpu").activations
        assert layer / (two - one) == pytest.approx(1, abs=0.05), (precision, layer, two - one)
        assert whole / two == pytest.approx(1, abs=0.05), (precision, whole, two)


def test_the_math_path_is_what_a_cpu_adds():
    """GPT-2 as shipped (dropout 0.1, SDPA) in bf16: the CUDA prediction misses what the CPU's
    math path keeps (predicted/measured ~0.6-0.8); the CPU prediction does not. With CUDA's
    dropout kernel swapped in (fused_dropout=True) only the math path's own mask stays fp32."""
    spec, s, b = _spec("gpt2", 192, 6, 6, 768, 3), 96, 2
    measured = _saved(spec, "sdpa", "bf16-mixed", True, s, b)
    cuda = estimate_memory(spec, batch_size=b, seq_len=s, attention="sdpa")
    cpu = estimate_memory(spec, batch_size=b, seq_len=s, attention="sdpa", device="cpu")
    assert cuda.inputs["attention"] == "sdpa" and cpu.inputs["attention"] == "sdpa-math"
    assert cuda.activations / measured < 0.85
    assert cpu.activations / measured == pytest.approx(1, abs=0.02)
    swapped = _saved(spec, "sdpa", "bf16-mixed", True, s, b, fused=True)
    both = estimate_memory(spec, batch_size=b, seq_len=s, attention="sdpa", device="cpu",
                           fused_dropout=True)
    assert swapped < measured and both.activations / swapped == pytest.approx(1, abs=0.02)


def test_device_changes_nothing_without_dropout():
    """No dropout: the CPU runs the fused SDPA kernel and keeps what CUDA keeps."""
    kw = dict(batch_size=2, seq_len=128, dropout=False)
    for model in ("debug-gpt2", "debug"):
        assert (estimate_memory(model, device="cpu", **kw).activations
                == estimate_memory(model, **kw).activations)
