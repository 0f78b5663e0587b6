"""`labkit plan`: the best layout, the top K with breakdown, rejections by reason; exit 2 with a
message on bad input, 1 when nothing fits."""
from __future__ import annotations

import subprocess
import sys

from labkit.cli import main
from labkit.planner import plan


def test_best_and_top_k(capsys):
    assert main(["plan", "llama3.2-1b", "--gpus", "8", "--global-batch", "256",
                 "--seq-len", "4096", "--top", "3"]) == 0
    out = capsys.readouterr().out
    best = plan("llama3.2-1b", 8, global_batch=256, seq_len=4096).best
    assert "best of" in out and str(best.layout) in out
    assert "top 3 (seconds per step by part)" in out
    table = out.split("top 3", 1)[1].split("rejected", 1)[0].strip().splitlines()
    assert len(table) == 1 + 1 + 3 and "bubble" in table[1]
    assert "rejected" in out and "memory:" in out and "e.g." in out


def test_nothing_fits_exits_1_and_says_why(capsys):
    assert main(["plan", "llama3-405b", "--gpus", "8", "--seq-len", "8192"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "model states alone" in out


def test_bad_input_is_a_message_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "labkit", "plan", "llama2-70b", "--gpus", "12"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "gpus=12 is not a whole number of nodes of gpus_per_node=8" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_model_gpu_and_top(capsys):
    assert main(["plan", "llama9", "--gpus", "8"]) == 2
    assert "not a known preset" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--gpus", "8", "--gpu", "v100"]) == 2
    assert "gpu='v100'" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--gpus", "8", "--top", "0"]) == 2
    assert "--top=0 must be a whole number >= 1" in capsys.readouterr().err
