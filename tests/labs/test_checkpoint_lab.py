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


def test_resume_refuses_a_checkpoint_of_other_flags(capsys, base, full):
    with pytest.raises(SystemExit):
        lab.parse_args(["--ckpt-dir", str(base / "full"), "--resume", "--steps", "9",
                        "--hidden", "128"])
    assert ("argument --resume: the checkpoint " in capsys.readouterr().err)
    args = lab.parse_args(["--ckpt-dir", str(base / "full"), "--resume", "--steps", "9"])
    args.hidden = 128
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
    args = lab.parse_args(["--crash-at-step", "2"])
    args.crash_rank = 4
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


# --- bad flags before any work; damaged checkpoints; a kill at the last moment of a save ---

@pytest.mark.parametrize("where, says", [
    ("file", "is a file, not a folder"), ("file/sub", "is under a file, not a folder"),
    ("/proc/ckpt", "no file can be written in '/proc/ckpt'")])
def test_ckpt_dir_that_cannot_be_written_is_refused_first(capsys, tmp_path, where, says):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        lab.parse_args(["--ckpt-dir", str(tmp_path / where)])
    err = capsys.readouterr().err.splitlines()[-1]
    assert "argument --ckpt-dir: " in err and says in err and "allowed: a folder" in err, err


@pytest.mark.parametrize("world, argv, says", [
    ("2", ["--crash-at-step", "2", "--crash-rank", "9"],
     "argument --crash-rank: 9 is not a rank of this run (2 ranks); allowed: 0 to 1"),
    ("3", [], "argument --global-batch: 8 does not split across 3 ranks; allowed: a multiple")])
def test_flags_that_do_not_fit_the_ranks_are_refused_first(capsys, monkeypatch, world, argv,
                                                           says):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit):
        lab.parse_args(argv)
    assert says in capsys.readouterr().err


@pytest.mark.multirank
@pytest.mark.parametrize("argv, says", [
    (["--ckpt-dir", "FILE"], "argument --ckpt-dir: 'FILE' is a file, not a folder"),
    (["--crash-at-step", "2", "--crash-rank", "9"], "argument --crash-rank: 9 is not a rank")])
def test_the_launcher_shows_the_one_line_not_a_traceback(tmp_path, argv, says):
    (tmp_path / "f").write_text("")
    argv = [a.replace("FILE", str(tmp_path / "f")) for a in argv]
    with pytest.raises(LabError) as info:
        run_lab("labkit.labs.checkpoint", nproc=2, timeout=120, quiet=True,
                args=["--steps", "3", *argv])
    text = str(info.value)
    assert says.replace("FILE", str(tmp_path / "f")) in text and "Traceback" not in text
    assert len(text.splitlines()) <= 8, text          # argparse's usage tail, then the error
    assert not any("step 1/3" in line for line in info.value.result.output)     # no work done


def damage(path: Path, how: str) -> None:
    """Damage checkpoint `path` as a bad disk or a cut copy would."""
    if how == "flip":                       # 4 KB inverted inside a shard
        f = path / "__1_0.distcp"
        data = bytearray(f.read_bytes())
        data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])
        f.write_bytes(bytes(data))
    elif how == "empty-metadata":
        (path / ".metadata").write_bytes(b"")
    else:                                   # a shard cut in half
        f = path / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


DAMAGES = [("flip", "__1_0.distcp: sha256 differs from the one saved"),
           ("empty-metadata", ".metadata: 0 B, saved "), ("cut", "__0_0.distcp: ")]


@pytest.mark.multirank
@pytest.mark.parametrize("how, says", DAMAGES)
def test_resume_names_a_damaged_checkpoint_and_takes_the_newest_intact(tmp_path, base, full,
                                                                       how, says):
    shutil.copytree(base / "full", tmp_path / "ck")
    damage(tmp_path / "ck" / "step_000006", how)
    args = lab.parse_args(["--ckpt-dir", str(tmp_path / "ck"), "--resume", "--steps", "8"])
    assert args.resume_from == (4, str(tmp_path / "ck" / "step_000004"))
    assert [step for step, _ in args.skipped] == [6] and says in args.skipped[0][1]
    assert checkpoint.damaged(tmp_path / "ck" / "step_000004") is None


@pytest.mark.multirank
def test_resume_with_no_intact_checkpoint_stops_with_one_message(capsys, tmp_path, base, full):
    shutil.copytree(base / "full", tmp_path / "ck")
    for step in (2, 4, 6):
        damage(tmp_path / "ck" / f"step_{step:06d}", "empty-metadata")
    with pytest.raises(SystemExit):
        lab.parse_args(["--ckpt-dir", str(tmp_path / "ck"), "--resume", "--steps", "8"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert ": error: argument --resume: no intact checkpoint in " in err, err
    assert "step 6 (.metadata: 0 B" in err and "step 2 (.metadata: 0 B" in err, err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "step_000002", "step_000004", "step_000006"]                # nothing deleted


@pytest.mark.multirank
def test_resume_past_a_damaged_checkpoint_says_so_and_trains_on(tmp_path, base, full):
    shutil.copytree(base / "full", tmp_path / "ck")
    damage(tmp_path / "ck" / "step_000006", "flip")
    result = run_lab("labkit.labs.checkpoint", nproc=2, timeout=180, quiet=True,
                     args=[*ARGS, "--ckpt-dir", str(tmp_path / "ck"), "--resume"])
    said = [line for line in result.output if "damaged" in line]
    assert said == ["[rank 0] --resume: skipped the damaged checkpoint of step 6 (__1_0.distcp: "
                    "sha256 differs from the one saved); resuming from step 4, the newest "
                    "intact one"], said
    r = result.results[0]
    assert r["resumed_from"] == 4 and r["saves"] == [6]
    diff = max(abs(a - b) for (_, a), (_, b) in zip(r["losses"][4:], full["losses"][4:]))
    assert diff <= 1e-5, diff
    for step in (4, 6):                     # the intact one kept; the damaged one saved anew
        assert checkpoint.damaged(tmp_path / "ck" / f"step_{step:06d}") is None


@pytest.mark.multirank
def test_a_damaged_checkpoint_without_sha256s_fails_in_one_line(tmp_path, base, full):
    """A checkpoint saved before labkit recorded sha256s: DCP's own error, named in one line."""
    shutil.copytree(base / "full", tmp_path / "ck")
    for step in (2, 4, 6):
        info = tmp_path / "ck" / f"step_{step:06d}" / "labkit.json"
        info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items()
                                    if k != "files"}))
    damage(tmp_path / "ck" / "step_000006", "flip")
    with pytest.raises(LabError) as err:
        run_lab("labkit.labs.checkpoint", nproc=2, timeout=180, quiet=True,
                args=["--steps", "8", "--ckpt-dir", str(tmp_path / "ck"), "--resume"])
    text = str(err.value)
    assert "Traceback" not in text and len(text.splitlines()) <= 5, text
    assert (f"--resume: the checkpoint '{tmp_path / 'ck' / 'step_000006'}' cannot be loaded "
            "(CheckpointException): it is damaged") in text


@pytest.mark.multirank
def test_a_kill_just_before_the_rename_leaves_a_checked_partial_never_picked(tmp_path):
    with pytest.raises(LabError) as info:
        run_lab(LABS / "ckpt_crash_at_rename.py", nproc=2, timeout=120, quiet=True,
                args=["--ckpt-dir", str(tmp_path)])
    assert (info.value.rank, info.value.reason) == (0, "signal")
    partial = tmp_path / "step_000002.partial"
    files = json.loads((partial / "labkit.json").read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert checkpoint.damaged(partial) is None                 # every file as recorded
    assert checkpoint.checkpoints(tmp_path) == [(1, str(tmp_path / "step_000001"))]
    assert lab.intact(tmp_path) == ((1, str(tmp_path / "step_000001")), [])
