"""`labkit mem`: a readable per-GPU table in GB and GiB; bad input is a message and exit 2."""
from __future__ import annotations

import subprocess
import sys

from labkit.cli import main


def test_llama2_70b_zero3_dp64(capsys):
    assert main(["mem", "llama2-70b", "--zero", "3", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    assert "GB" in out and "GiB" in out
    for term in ("params", "grads", "optimizer_states", "activations", "total"):
        assert term in out
    assert "ZeRO-3" in out and "does NOT fit on NVIDIA H100 SXM 80GB" in out
    # model states: 16 B/param over 64 ranks = 17.24 GB
    assert "12.93" in out      # optimizer states: 12 x 68,976,648,192 / 64 / 1e9


def test_fitting_plan(capsys):
    args = ["mem", "llama2-70b", "--zero", "1", "--dp", "8", "--tp", "8", "--pp", "4",
            "--microbatches", "8", "--seq-len", "4096", "--sequence-parallel",
            "--recompute", "selective", "--gpu", "h100-sxm"]
    assert main(args) == 0
    assert "fits on NVIDIA H100 SXM 80GB" in capsys.readouterr().out


def test_parameter_count(capsys):
    assert main(["mem", "7.5e9", "--precision", "fp16-mixed", "--optimizer", "adam",
                 "--zero", "2", "--dp", "64"]) == 0
    assert "16.64" in capsys.readouterr().out           # ZeRO Figure 1: 16.6 GB


def test_bad_input_is_a_message_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "labkit", "mem", "llama2-70b", "--tp", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "tp=3 does not divide num_heads=64; allowed: 1, 2, 4, 8, 16, 32, 64" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_preset_and_gpu(capsys):
    assert main(["mem", "llama9"]) == 2
    assert "not a known preset" in capsys.readouterr().err
    assert main(["mem", "gpt2", "--gpu", "v100"]) == 2
    assert "gpu='v100'" in capsys.readouterr().err


def _fixes(out: str) -> list[tuple[list[str], float]]:
    """The changes `labkit mem` proposes, as (flags, GB), from its output."""
    lines = out.split("it fits on", 1)[1].splitlines()[1:] if "it fits on" in out else []
    return [(line.rsplit(None, 2)[0].split(), float(line.rsplit(None, 2)[1])) for line in lines if line.strip()]


def test_readme_example_says_what_would_make_it_fit(capsys):
    """The README's own example does not fit; recomputation is the lever it must name, with the
    total that change gives, and every change it proposes really fits."""
    from labkit.hardware import GB
    from labkit.memory import estimate_memory

    base = ["mem", "llama2-70b", "--zero", "3", "--dp", "64"]
    assert main(base) == 0
    fixes = _fixes(capsys.readouterr().out)
    assert fixes and fixes[0][0] == ["--recompute", "full"], fixes
    full = estimate_memory("llama2-70b", zero_stage=3, dp=64, recompute="full")
    assert fixes[0][1] == round(full.total / GB, 2)
    for flags, _ in fixes:
        assert main(base + flags) == 0
        assert "fits on NVIDIA H100 SXM 80GB" in capsys.readouterr().out, flags
    # the smallest step: selective recomputation is not enough, so it is not proposed
    assert main(base + ["--recompute", "selective"]) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_two_changes_when_one_is_not_enough(capsys):
    assert main(["mem", "llama2-70b"]) == 0
    fixes = _fixes(capsys.readouterr().out)
    assert fixes and all(sum(f.startswith("--") for f in flags) >= 2 for flags, _ in fixes), fixes
    for flags, _ in fixes:
        assert main(["mem", "llama2-70b", *flags]) == 0
        assert "fits on" in capsys.readouterr().out, flags


def test_no_fix_is_said_plainly(capsys):
    assert main(["mem", "1e13"]) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "no change of one or two levers" in out and "it fits on" not in out


def test_sequence_parallel_needs_tensor_parallelism(capsys):
    assert main(["mem", "llama2-7b", "--sequence-parallel"]) == 2
    assert "--sequence-parallel needs --tp > 1" in capsys.readouterr().err
    assert main(["mem", "llama2-7b", "--sequence-parallel", "--tp", "2"]) == 0


def test_implementation_and_attention_change_the_activations(capsys):
    """--implementation/--attention reach estimate_memory: Megatron's eager GPT-2 layer keeps
    the s x s scores that transformers' SDPA default does not, so its activations are larger."""
    from labkit.memory import estimate_memory

    base = ["mem", "gpt2", "--seq-len", "1024", "--batch-size", "8"]
    acts = {}
    for extra in ([], ["--implementation", "megatron", "--attention", "eager"]):
        assert main(base + extra) == 0
        row = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("activations"))
        acts[bool(extra)] = float(row.split()[1])
    want = estimate_memory("gpt2", batch_size=8, seq_len=1024, implementation="megatron",
                           attention="eager").activations / 1e9
    assert acts[True] == round(want, 2) and acts[True] > acts[False]


def test_offload_lists_host_memory(capsys):
    assert main(["mem", "llama2-7b", "--zero", "3", "--dp", "8", "--offload", "params"]) == 0
    out = capsys.readouterr().out
    assert "host (offload)" in out


def test_bad_attention_is_a_message(capsys):
    assert main(["mem", "gpt2", "--attention", "flash"]) == 2
    assert "attention='flash' is not supported; allowed: 'eager', 'sdpa'" in capsys.readouterr().err
