"""The memory lab against labkit's formulas: model states exactly (ratio 1.000), activations
saved for backward within 10% of Korthikanti et al. (the lab gets 1.001 without recompute: what is
left is LayerNorm statistics and the int64 token ids; 1.048 with full recompute, where
transformers also keeps the causal mask it passes to every checkpointed layer). With --model
debug-llama, transformers' Llama against its own terms (labkit.activations): 1.001."""
from __future__ import annotations

import pytest

from labkit.runtime.launch import run_lab
from labkit.memory import bytes_per_param



def _check(r: dict, precision: str) -> None:
    for term in ("params", "grads", "optimizer_states", "model_states"):
        assert r["measured"][term] == r["predicted"][term], (term, r["measured"], r["predicted"])
        assert round(r["ratio"][term], 3) == 1.000
    assert r["measured"]["model_states"] == r["num_params"] * bytes_per_param(precision, "adamw")
    # AdamW's step counter: one 4-byte tensor per parameter tensor, reported apart.
    assert r["optimizer_steps"] == 4 * r["num_param_tensors"]
    assert abs(r["ratio"]["activations"] - 1) <= 0.10, r["ratio"]


@pytest.mark.multirank       # run_lab starts the lab under torchrun
def test_one_rank_bf16_mixed_matches_the_formulas():
    result = run_lab("labkit.labs.memory", nproc=1, timeout=180, quiet=True)
    (r,) = result.results
    _check(r, "bf16-mixed")
    assert r["precision"] == "bf16-mixed"
    # 16 bytes per parameter, split 2 + 2 + 12 (the fp32 master copy is an optimizer state).
    assert r["measured"]["params"] == 2 * r["num_params"]
    assert r["measured"]["optimizer_states"] == 12 * r["num_params"]
    assert abs(r["ratio"]["activations"] - 1) <= 0.01
    assert len(r["losses"]) == 3 and all(loss > 0 for loss in r["losses"])


@pytest.mark.multirank
def test_two_ranks_bf16_full_recompute():
    """Data parallelism replicates model states and does not divide a micro-batch's
    activations: both ranks hold the same bytes as a single rank would."""
    result = run_lab("labkit.labs.memory", nproc=2, timeout=180, quiet=True,
                     args=["--precision", "bf16", "--recompute", "full"])
    a, b = result.results
    for r in (a, b):
        _check(r, "bf16")
        assert r["world_size"] == 2 and r["recompute"] == "full"
        assert r["measured"]["model_states"] == 8 * r["num_params"]     # 2 + 2 + 4
    assert a["measured"] == b["measured"]


@pytest.mark.multirank
@pytest.mark.parametrize("args", [[], ["--attention", "eager", "--precision", "fp32",
                                       "--recompute", "full"]])
def test_llama_matches_transformers_llama_activations(args):
    """--model debug-llama: transformers' Llama (RMSNorm keeping an fp32 copy, SwiGLU, 4 of 8
    K/V heads) measured against implementation="hf-llama" (SDPA unless --attention eager)."""
    result = run_lab("labkit.labs.memory", nproc=1, timeout=180, quiet=True,
                     args=["--model", "debug-llama", *args])
    (r,) = result.results
    precision = "fp32" if args else "bf16-mixed"
    _check(r, precision)
    assert (r["model"], r["implementation"]) == ("debug-llama", "hf-llama")
    assert r["attention"] == ("eager" if args else "sdpa")
    assert (r["heads"], r["kv_heads"], r["ffn"]) == (8, 4, 256)
    assert abs(r["ratio"]["activations"] - 1) <= 0.05, r["ratio"]


def test_lab_predicts_the_implementation_it_builds():
    import argparse

    from labkit.labs.memory import implementation
    from labkit.labs.common.models import lab_spec

    def args(**kw):
        base = dict(model="debug-gpt2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=128,
                    seq=32, attention=None, activation="gelu_pytorch_tanh")
        return argparse.Namespace(**{**base, **kw})

    gpt2 = lab_spec(args())
    assert (gpt2.arch, gpt2.ffn_size, gpt2.num_kv_heads) == ("gpt2", 256, 4)
    assert implementation(gpt2, args()) == ("megatron", "eager")
    assert implementation(gpt2, args(activation="gelu_new")) == ("hf-gpt2", "eager")
    llama = lab_spec(args(model="debug-llama"))
    assert (llama.arch, llama.ffn_size, llama.num_kv_heads) == ("llama", 128, 2)
    assert implementation(llama, args(model="debug-llama")) == ("hf-llama", "sdpa")


def test_master_weights_update_an_fp32_copy():
    torch = pytest.importorskip("torch")
    from labkit.labs.common.models import MasterWeights

    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = MasterWeights(layer.parameters(), lr=1e-2)
    layer(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    assert all(m.dtype == torch.float32 and m.grad is None for m in opt.master)   # grad: temporary
    for p, m in zip(layer.parameters(), opt.master):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
        state = opt.optimizer.state[m]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert opt.master_bytes() == 4 * sum(p.numel() for p in layer.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in layer.parameters())


def test_fused_dropout_saves_a_one_byte_mask():
    torch = pytest.importorskip("torch")
    from labkit.labs.common.models import fused_dropout
    from labkit.runtime.measure import SavedActivations

    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    with SavedActivations() as composite:
        torch.nn.functional.dropout(x, 0.1, training=True)
    with fused_dropout(), SavedActivations() as fused:
        y = torch.nn.functional.dropout(x, 0.1, training=True)
    assert fused.bytes == x.numel() and dict(fused.by_dtype) == {"bool": x.numel()}
    assert composite.bytes == 2 * x.numel()      # torch's CPU dropout: a bf16 mask
    assert y.dtype == torch.bfloat16
    # Outside the block dropout is torch's own again.
    assert torch.nn.functional.dropout.__module__ == "torch.nn.functional"


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "argument --steps: '0' is not a whole number >= 1"),
    (["--layers", "-1"], "argument --layers: '-1' is not a whole number >= 1"),
    (["--layers", "200000"], "argument --layers: 200000 must be a whole number >= 1 and <= 100,"),
    (["--heads", "3"], "argument --heads: 3 does not divide --hidden 128; allowed: 1, 2, 4"),
    (["--model", "debug-llama", "--kv-heads", "3"], "argument --kv-heads: 3 does not divide "
                                                    "--heads 8"),
    (["--model", "debug-llama", "--hidden", "66", "--heads", "6", "--kv-heads", "3"],
     "argument --heads: 6 makes an odd head size, --hidden 66 / 6 = 11, which RoPE refuses"),
])
def test_bad_flags_are_refused_by_their_name_before_any_work(capsys, argv, says):
    from labkit.labs.memory import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err


@pytest.mark.multirank
def test_steps_0_through_the_launcher_is_one_line_not_a_traceback():
    from labkit.runtime.launch import LabError

    with pytest.raises(LabError) as info:
        run_lab("labkit.labs.memory", nproc=1, timeout=120, quiet=True, args=["--steps", "0"])
    text = str(info.value)
    assert "argument --steps: '0' is not a whole number >= 1" in text
    assert "Traceback" not in text and len(text.splitlines()) <= 8, text
