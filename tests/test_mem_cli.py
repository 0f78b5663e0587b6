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
