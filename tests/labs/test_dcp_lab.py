"""Module 05's DCP lab (labkit.labs.dcp): each --part on 2 gloo ranks (reshard: 4 then 2).

Expected values are computed here from the model's shapes: P parameters of the lab's Llama
(2 blocks, h 64, vocabulary 512, untied), 21 parameter tensors, so each rank's shard file holds
12P/N bytes of tensors (fp32 weights and AdamW's two moments) and the step counters add 4 bytes
per tensor once over all ranks. No assertion is on speed: only on the order of the times.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from labkit.labs import dcp as lab
from labkit.runtime.launch import resolve_target, run_lab

N, H, V, LAYERS = 2, 64, 512, 2


def llama() -> tuple[int, int]:
    """(parameters, tensors): embedding and head V x h, final norm h; per block q, o (h x h),
    k, v (h x h/2), gate, up, down (h x 2h), two norms (h): 9 tensors."""
    per_block = 2 * H * H + 2 * H * (H // 2) + 3 * H * 2 * H + 2 * H
    return 2 * V * H + H + LAYERS * per_block, 3 + 9 * LAYERS


def part(name, nproc=N, *extra):
    result = run_lab("labkit.labs.dcp", nproc=nproc, timeout=180, quiet=True,
                     args=["--part", name, *extra])
    return result.results[0]


@pytest.mark.multirank
def test_save_writes_one_file_per_rank_with_12P_over_N_bytes_and_loads_back_exactly():
    r = part("save")
    P, T = llama()
    assert (r["num_params"], r["param_tensors"]) == (P, T)
    assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "labkit.json"]
    shards = [r["by_file"][f"__{k}_0.distcp"] for k in range(N)]
    assert [s["tensor_bytes"] for s in shards] == [12 * P // N] * N
    assert sum(s["counter_bytes"] for s in shards) == 4 * T == r["counter_bytes_total"]
    assert all(s["file_bytes"] > s["tensor_bytes"] + s["counter_bytes"] for s in shards)
    assert r["predicted"] == {"model": 4 * P // N, "optim": 8 * P // N, "counters_total": 4 * T}
    assert r["ratio"] == {f"__{k}_0.distcp": 1.0 for k in range(N)}
    assert r["changed_by_a_step"] and r["equal_after_load"] and r["loaded_step"] == 1


@pytest.mark.multirank
def test_async_save_returns_before_it_is_written_and_saves_the_state_at_the_call():
    r = part("async")
    assert 0 < r["returned_s"] <= r["done_s"]
    assert r["blocking_s"] > 0 and r["copy_s"] >= 0
    assert r["saved_is_state_at_call"] is True and r["training_changed_it"] is True
    assert r["steps_while_writing"] >= 0


@pytest.mark.multirank
def test_async_save_returns_before_the_ranks_agree_on_the_plan():
    """torch 2.13 stages, then runs save() (planning, its collectives, the writes) in a thread:
    on every rank planning waited for the call's return, ran off the main thread, and the plan
    was agreed after the return and before the write finished."""
    r = part("async")
    assert r["planned_after_return"] is True, r["planning"]
    assert len(r["planning"]) == N and "MainThread" not in r["planning_threads"]
    for p in r["planning"]:
        assert p["held"] is True and p["returned_s"] < p["set_up_s"] < p["agreed_s"], p
    assert r["returned_s"] < r["planning"][0]["global_s"] < r["plan_agreed_s"] < r["done_s"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_planner_probe_tells_a_blocking_save_from_an_async_one(tmp_path, monkeypatch):
    """One process: dcp.save plans inside the call (the hold times out: held False, on the
    main thread); dcp.async_save returns first (held True, on its executor's thread)."""
    monkeypatch.setattr(lab, "HOLD_S", 0.2)
    state = {"w": torch.arange(6.0)}
    blocking = lab.WatchedPlanner(threading.Event())
    dcp.save(state, checkpoint_id=str(tmp_path / "b"), planner=blocking, no_dist=True)
    assert (blocking.held, blocking.thread) == (False, "MainThread")
    returned = threading.Event()
    early = lab.WatchedPlanner(returned)
    future = dcp.async_save(state, checkpoint_id=str(tmp_path / "a"), planner=early, no_dist=True)
    returned.set()
    getattr(future, "upload_completion", future).result()
    assert early.held is True and early.thread != "MainThread"
    assert early.times["set_up"] < early.times["agreed"]


@pytest.mark.multirank
def test_reshard_4_to_2_loads_equal_full_tensors(tmp_path):
    saved = part("reshard", 4, "--ckpt-dir", str(tmp_path))
    assert saved == {"part": "reshard", "phase": "save", "world_size": 4, "tensors": 4 * 21}
    loaded = part("reshard", 2, "--ckpt-dir", str(tmp_path))
    assert (loaded["phase"], loaded["world_size"], loaded["saved_by"]) == ("load", 2, 4)
    assert loaded["differed_before"] and loaded["equal"] and loaded["max_diff"] == 0.0
    assert loaded["tensors"] == 4 * llama()[1]      # weights, two moments, a step per tensor


@pytest.mark.multirank
def test_export_gives_one_file_a_plain_model_loads_with_the_same_logits():
    r = part("export")
    P, T = llama()
    assert r["num_params"] == P and r["keys"] == T and r["full_bytes"] == 4 * P
    assert set(r["logits_max_diff"]) <= {"torch.save", "safetensors"}
    assert all(d == 0.0 for d in r["logits_max_diff"].values()), r["logits_max_diff"]
    assert r["files"]["model.pt"] >= 4 * P and r["converted_equal"] is True


@pytest.mark.parametrize("argv, says", [
    (["--part", "reshard"], "argument --ckpt-dir: --part reshard runs as two launches"),
    (["--part", "save", "--phase", "load"], "argument --phase: only --part reshard has phases"),
    (["--part", "zip"], "argument --part: invalid choice: 'zip'"),
    (["--part", "save", "--heads", "5"], "argument --heads: 5 must divide --hidden 64"),
])
def test_bad_flags_say_which_and_what_is_allowed(capsys, argv, says):
    with pytest.raises(SystemExit):
        lab.parse_args(argv)
    assert says in capsys.readouterr().err


def test_load_phase_without_a_checkpoint_says_so(tmp_path):
    args = lab.parse_args(["--part", "reshard", "--phase", "load", "--ckpt-dir", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        lab.part_reshard(args, None, str(tmp_path))


def test_labkit_run_finds_the_lab_by_its_short_name():
    assert resolve_target("dcp") == "labkit.labs.dcp"
