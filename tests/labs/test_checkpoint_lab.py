"""Module 05's crash lab (labkit.labs.checkpoint) and labkit.parallel.checkpoint.

One uninterrupted 4-rank run and one run whose last rank is killed with SIGKILL at step 5 are
shared by the assertions (module fixtures); resuming must give the uninterrupted run's losses
exactly on 4 ranks and within 1e-5 on 2 (the same global batch, other sums' order). A rank
killed inside a save must leave nothing that `latest` picks. Small Llama (2 blocks, h 64), 6
steps: each launch takes a few seconds once the warm pool has imported transformers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from labkit.labs import checkpoint as lab
from labkit.parallel import checkpoint
from labkit.runtime.launch import LabError, resolve_target, run_lab

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
STEPS, EVERY, CRASH = 6, 2, 5
ARGS = ["--steps", str(STEPS), "--save-every", str(EVERY)]


def launch(nproc, ckpt, *extra):
    return run_lab("labkit.labs.checkpoint", nproc=nproc, timeout=180, quiet=True,
                   args=[*ARGS, "--ckpt-dir", str(ckpt), *extra])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def full(base):
    return launch(4, base / "full").results[0]


@pytest.fixture(scope="module")
def crashed(base, full):
    with pytest.raises(LabError) as info:
        launch(4, base / "crash", "--crash-at-step", str(CRASH))
    return info.value


@pytest.mark.multirank
def test_uninterrupted_run_saves_every_k_steps_and_its_loss_falls(base, full):
    assert [s for s, _ in full["losses"]] == list(range(1, STEPS + 1))
    assert full["saves"] == [2, 4, 6] and full["resumed_from"] is None
    assert full["losses"][-1][1] < full["losses"][0][1]          # learnable data: it trains
    assert checkpoint.latest(base / "full") == (6, str(base / "full" / "step_000006"))
    meta = checkpoint.info(base / "full" / "step_000004")
    assert meta["step"] == 4 and meta["world_size"] == 4
    assert meta["extra"]["losses"] == full["losses"][:4]
    # one shard file per rank, and DCP's index
    names = {p.name for p in (base / "full" / "step_000004").iterdir()}
    assert {f"__{r}_0.distcp" for r in range(4)} | {".metadata", "labkit.json"} == names


@pytest.mark.multirank
def test_killed_rank_is_named_with_its_signal(crashed, full):
    assert (crashed.reason, crashed.rank, crashed.exc_type) == ("signal", 3, None)
    first = str(crashed).splitlines()[0]
    assert "rank 3 was killed by SIGKILL" in first, first
    assert "killing myself with SIGKILL at step 5" in str(crashed)
    assert crashed.result.ranks[3].exit_code == -9
    # what rank 0 reported before the crash survives it: steps 1-4, equal to the clean run's
    assert crashed.result.results[0]["losses"] == full["losses"][:CRASH - 1]
    assert crashed.result.results[0]["saves"] == [2, 4]


@pytest.fixture(scope="module")
def resumed(base, crashed):
    assert checkpoint.latest(base / "crash")[0] == 4
    return launch(4, base / "crash", "--resume").results[0]


@pytest.mark.multirank
def test_resume_on_the_same_world_size_gives_exactly_the_same_losses(resumed, full):
    r = resumed
    assert r["resumed_from"] == 4 and r["saves"] == [6]
    assert r["losses"] == full["losses"]                  # every step, exactly (==)
    assert r["losses"][4:] == full["losses"][4:] and len(r["losses"]) == STEPS


@pytest.mark.multirank
def test_resume_4_to_2_ranks_within_1e_5(base, crashed, full):
    ckpt = base / "from_step_2"
    ckpt.mkdir()
    shutil.copytree(base / "full" / "step_000002", ckpt / "step_000002")
    r = launch(2, ckpt, "--resume").results[0]
    assert r["world_size"] == 2 and r["resumed_from"] == 2
    assert [s for s, _ in r["losses"]] == list(range(1, STEPS + 1))
    diff = max(abs(a - b) for (_, a), (_, b) in zip(r["losses"][2:], full["losses"][2:]))
    assert diff <= 1e-5, diff


@pytest.mark.multirank
@pytest.mark.parametrize("when, dead", [("data", 1), ("metadata", 0)])
def test_a_save_cut_by_a_crash_is_never_the_latest(tmp_path, when, dead):
    with pytest.raises(LabError) as info:
        run_lab(LABS / "ckpt_crash_in_save.py", nproc=2, timeout=120, quiet=True,
                args=["--ckpt-dir", str(tmp_path), "--when", when])
    assert (info.value.rank, info.value.reason) == (dead, "signal")
    partial = tmp_path / "step_000002.partial"
    assert (partial / "__0_0.distcp").is_file() and (partial / "__1_0.distcp").is_file()
    assert (partial / ".metadata").is_file() == (when == "metadata")
    assert checkpoint.latest(tmp_path) == (1, str(tmp_path / "step_000001"))


def test_latest_skips_incomplete_and_foreign_folders(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None

    def fake(name, files):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text(json.dumps({"step": 0}))

    fake("step_000003", [".metadata", "labkit.json"])
    fake("step_000009", [".metadata"])                          # no labkit.json: cut short
    fake("step_000008", ["labkit.json"])                        # no DCP index
    fake("step_000007.partial", [".metadata", "labkit.json"])   # never renamed
    fake("step_12", [".metadata", "labkit.json"])               # not labkit's name
    assert checkpoint.latest(tmp_path) == (3, str(tmp_path / "step_000003"))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.info(tmp_path / "step_000009")
    with pytest.raises(ValueError, match="step=-1 must be a whole number"):
        checkpoint.step_dir(tmp_path, -1)


@pytest.mark.parametrize("argv, says", [
    (["--resume"], "argument --ckpt-dir: needed by --resume"),
    (["--save-every", "2"], "argument --ckpt-dir: needed by --resume and --save-every"),
    (["--steps", "4", "--crash-at-step", "5"], "argument --crash-at-step: 5 is after the last"),
    (["--heads", "3"], "argument --heads: 3 must divide --hidden 64 and be even"),
    (["--crash-rank", "-1"], "argument --crash-rank: -1 is not a rank"),
    (["--lr", "2"], "argument --lr: 2.0 is not a learning rate"),
    (["--steps", "0"], "'0' is not a whole number >= 1"),
])
def test_bad_flags_say_which_and_what_is_allowed(capsys, argv, says):
    with pytest.raises(SystemExit):
        lab.parse_args(argv)
    assert says in capsys.readouterr().err


def test_resume_with_no_checkpoint_says_so(capsys, tmp_path):
    (tmp_path / "step_000002.partial").mkdir()
    with pytest.raises(SystemExit):
        lab.parse_args(["--ckpt-dir", str(tmp_path), "--resume"])
    err = capsys.readouterr().err
    assert f"argument --resume: no complete checkpoint in {str(tmp_path)!r}" in err
    assert "run without --resume first" in err


def test_resume_refuses_a_checkpoint_of_other_flags(base, full):
    args = lab.parse_args(["--ckpt-dir", str(base / "full"), "--resume", "--steps", "9",
                           "--hidden", "128"])
    with pytest.raises(ValueError, match=r"other flags \(hidden: saved 64, now 128\)"):
        lab.resume(args, None, None)

def test_resume_of_a_finished_run_says_so(capsys, base, full):
    with pytest.raises(SystemExit):
        lab.parse_args(["--ckpt-dir", str(base / "full"), "--resume", "--steps", "6"])
    assert ("argument --steps: 6 steps are done already (the checkpoint is of step 6); "
            "allowed: more than 6") in capsys.readouterr().err


def test_global_batch_must_split_across_the_ranks(tmp_path):
    args = lab.parse_args(["--global-batch", "8"])
    ctx = SimpleNamespace(world_size=3, rank=0, device="cpu")
    with pytest.raises(ValueError, match="--global-batch 8 does not split across 3 ranks; "
                                         "allowed: a multiple of 3"):
        lab.run(args, ctx)
    args = lab.parse_args(["--crash-at-step", "2", "--crash-rank", "4"])
    with pytest.raises(ValueError, match="--crash-rank 4 is not a rank of this run; allowed: "
                                         "0 to 1"):
        lab.run(args, SimpleNamespace(world_size=2, rank=0, device="cpu"))


def test_labkit_run_finds_the_lab_by_its_short_name():
    assert resolve_target("checkpoint") == "labkit.labs.checkpoint"


@pytest.mark.multirank
def test_resume_figure_marks_saves_crash_and_resume(full, crashed, resumed):
    from labkit.plots.checkpoint import max_difference, resume_figure

    fig = resume_figure(full["losses"], crashed=crashed.result.results[0], resumed=resumed)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["uninterrupted", "crashed run", "checkpoint", f"crash (step {CRASH})",
                      "resumed on 4 ranks", "resume from step 4"]
    assert "max |diff| 0.0e+00 (exact)" in ax.get_title()
    lines = {l.get_label(): l for l in ax.lines}
    assert list(lines["resumed on 4 ranks"].get_xdata()) == [5, 6]
    assert list(lines["crashed run"].get_xdata()) == [1, 2, 3, 4]
    assert max_difference(full["losses"], [[5, full["losses"][4][1] + 0.25]], after=4) == 0.25


def test_resume_figure_refuses_what_is_not_a_loss_list():
    from labkit.plots.checkpoint import max_difference, resume_figure

    with pytest.raises(ValueError, match=r"uninterrupted must be a list of \[step, loss\]"):
        resume_figure([1.0, 2.0])
    with pytest.raises(ValueError, match="finite loss"):
        resume_figure([[1, float("nan")]])
    with pytest.raises(ValueError, match="no step after 3 is in both runs"):
        max_difference([[1, 1.0]], [[4, 1.0]], after=3)
