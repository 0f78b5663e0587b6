"""labkit.runtime.dist inside a rank: reporting records, conversions, backend choice, one-process labs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from labkit.runtime import dist


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(dist.ENV_RESULTS_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(dist, "_reports", [])
    return tmp_path


def records(path):
    return [json.loads(line) for line in (path / "rank3.jsonl").read_text().splitlines()]


def test_report_writes_json_lines_and_merges(results_dir):
    import torch

    dist.report(loss=torch.tensor(1.5), sizes=torch.tensor([1, 2]))
    dist.report(loss=0.5, step=2)
    recs = records(results_dir)
    assert [r["kind"] for r in recs] == ["report", "report"]
    assert recs[0]["metrics"] == {"loss": 1.5, "sizes": [1, 2]}
    assert dist.reported() == {"loss": 0.5, "sizes": [1, 2], "step": 2}


def test_jsonable_converts_what_labs_report():
    import numpy as np

    @dataclass
    class Point:
        x: int
        y: float

    value = {"a": np.float32(2.5), "b": (1, 2), "c": Point(1, 2.0), 4: None, "d": object}
    out = dist._jsonable(value)
    assert out == {"a": 2.5, "b": [1, 2], "c": {"x": 1, "y": 2.0}, "4": None,
                   "d": "<class 'object'>"}
    json.dumps(out)


def test_progress_prints_on_rank_zero_only(results_dir, monkeypatch, capsys):
    dist.progress(3, 10, loss=2.31)
    assert capsys.readouterr().out == ""          # RANK=3
    monkeypatch.setenv("RANK", "0")
    dist.progress(3, 10, loss=2.31)
    assert capsys.readouterr().out == "step 3/10  loss 2.3100\n"
    assert records(results_dir)[0] == {**records(results_dir)[0], "kind": "progress", "step": 3,
                                       "total": 10, "metrics": {"loss": 2.31}}


def test_lifecycle_records(results_dir):
    dist._begin()
    try:
        raise ValueError("bad")
    except ValueError as exc:
        tb = dist._record_error(exc)
    recs = records(results_dir)
    assert recs[0]["kind"] == "start" and recs[0]["rank"] == 3 and recs[0]["pid"] == os.getpid()
    assert recs[1]["exc_type"] == "ValueError" and recs[1]["message"] == "bad"
    assert "test_dist.py" in tb and tb == recs[1]["traceback"]


def test_report_without_a_launcher_is_kept(monkeypatch):
    monkeypatch.delenv(dist.ENV_RESULTS_DIR, raising=False)
    monkeypatch.setattr(dist, "_reports", [])
    dist.report(x=1)
    assert dist.reported() == {"x": 1}


def test_setup_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend='mpi' is not supported; allowed: 'gloo', 'nccl'"):
        dist.setup("mpi")


def test_backend_override_by_environment(monkeypatch):
    from labkit.runtime import system

    monkeypatch.setenv("LABKIT_BACKEND", "gloo")
    assert system.default_backend(8) == "gloo"


def test_a_lab_runs_as_one_process_without_torchrun():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", dist.ENV_RESULTS_DIR)}
    proc = subprocess.run([sys.executable, "-m", "labkit.labs.hello"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 1" in proc.stdout and "all_reduce(rank + 1) = 1 (expected 1)" in proc.stdout


def test_setup_seeds_every_generator_and_shutdown_keeps_the_process():
    code = ("import random, torch; from labkit.runtime import dist\n"
            "ctx = dist.setup(seed=7); a = (random.random(), torch.rand(1).item())\n"
            "assert dist.setup() is ctx\n"
            "dist.shutdown(); random.seed(7); torch.manual_seed(7)\n"
            "assert a == (random.random(), torch.rand(1).item())\n"
            "print(ctx.rank, ctx.world_size, ctx.backend, ctx.device, ctx.is_main)")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1", "gloo", "cpu", "True"]
