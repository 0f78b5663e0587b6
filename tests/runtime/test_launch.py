"""labkit.runtime.launch: results and timings come back, output streams live with a rank prefix, the
CLI, the %%torchrun magic and argument checks."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.runtime.launch import LabError, resolve_target, run_lab

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
multirank = pytest.mark.multirank


@multirank
def test_hello_two_ranks_reports_and_timings(capsys):
    result = run_lab("labkit.labs.hello", nproc=2, timeout=120)
    assert result.ok and result.returncode == 0
    assert [r["rank"] for r in result.results] == [0, 1]
    for r in result.results:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["all_reduce"] == r["expected"] == 3.0
    assert [(r.rank, r.exit_code) for r in result.ranks] == [(0, 0), (1, 0)]
    assert all(0 < r.wall_time < result.wall_time for r in result.ranks)
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 on " in out
    assert "torchrun" not in out                   # torchrun's own log stays out of the cell


class _Clock:
    """A stand-in for sys.stdout that records when each line arrives."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text):
        for line in text.splitlines():
            self.lines.append((time.monotonic(), line))

    def flush(self):
        pass


@multirank
def test_output_is_streamed_live_and_script_args_pass(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sys, "stdout", clock)
    result = run_lab(LABS / "slow_print.py", nproc=2, args=["--sleep", "3"], timeout=120)
    monkeypatch.undo()
    when = {line: t for t, line in clock.lines}
    assert when["[rank 0] tick 1 from 0"] - when["[rank 0] tick 0 from 0"] >= 2.0
    assert "[rank 0] step 1/2  loss 0.5000" in when      # progress() prints on rank 0 only
    assert not any(line.startswith("[rank 1] step") for line in when)
    for rank in (0, 1):   # output printed just before the ranks exit is all there, in order
        burst = [o for o in result.output if o.startswith(f"[rank {rank}] burst ")]
        assert burst == [f"[rank {rank}] burst {i} from {rank}" for i in range(200)]
    # reports merge per rank; args reached the lab
    assert result.results[1] == {"rank": 1, "slept": 3.0, "done": True}


@multirank
def test_cli_run_hello():
    proc = subprocess.run([sys.executable, "-m", "labkit", "run", "hello", "-n", "2",
                           "--timeout", "120"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "[rank 1] rank 1 of 2" in proc.stdout
    assert "finished on 2 rank(s)" in proc.stderr


@multirank
def test_torchrun_cell_magic(monkeypatch):
    # Ranks get one thread each even when the caller set nothing (2 cores, N ranks).
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "labkit")
    cell = ("x = torch.tensor([float(rank)])\ndist.all_reduce(x)\n"
            "report(total=x.item(), ws=world_size, threads=torch.get_num_threads())\n")
    result = shell.run_cell_magic("torchrun", "-n 2 --timeout 120 --quiet", cell)
    assert result.results == [{"total": 1.0, "ws": 2, "threads": 1}] * 2
    assert shell.user_ns["_torchrun"] is result
    with pytest.raises(LabError) as info:
        shell.run_cell_magic("torchrun", "-n 2 --timeout 120 --quiet",
                             "if rank == 1:\n    raise KeyError('nope')\ndist.barrier()\n")
    assert info.value.rank == 1 and info.value.exc_type == "KeyError"
    assert 'torchrun_cell.py", line 2' in info.value.traceback   # line numbers are the cell's


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="nproc=0 must be a whole number >= 1"):
        run_lab("hello", nproc=0)
    with pytest.raises(ValueError, match="timeout=-1 must be a number > 0"):
        run_lab("hello", nproc=2, timeout=-1)
    with pytest.raises(ValueError, match="labs: .*hello"):
        run_lab("no_such_lab", nproc=2)
    with pytest.raises(ValueError, match="no such script"):
        run_lab("missing/lab.py", nproc=2)
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        run_lab("hello", nproc=2, nnodes=2)


def test_targets_resolve():
    assert resolve_target("hello") == "labkit.labs.hello"
    assert resolve_target("labkit.labs.hello") == "labkit.labs.hello"
    assert resolve_target(LABS / "slow_print.py") == str(LABS / "slow_print.py")


def test_bench_registry_discovers_and_registers(capsys):
    from labkit.cli import bench

    assert "launcher" in bench.benchmarks()
    calls = []
    bench.register("fake", lambda argv: calls.append(argv) or 0, "a test benchmark")
    try:
        args = type("A", (), {"name": "fake", "bench_args": ["--", "--x", "1"]})()
        assert bench.run(args) == 0 and calls == [["--x", "1"]]
        args.name = "nope"
        assert bench.run(args) == 2
        assert "allowed: " in capsys.readouterr().err
    finally:
        bench._REGISTRY.pop("fake")


def test_import_labkit_stays_light():
    code = "import sys, labkit, labkit.runtime.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rank_log_files_are_tailed_in_whole_lines(tmp_path, capsys):
    """torchrun's own --tee prints a half-written line as two; LogTail joins them."""
    from labkit.runtime.launch import LogTail, _Printer

    rank_dir = tmp_path / "run_x" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    log = rank_dir / "stdout.log"
    printer = _Printer(quiet=False, verbose=False, label=lambda local: f"rank {local}")
    tail = LogTail(str(tmp_path))
    tail.poll(printer)                                   # nothing yet
    log.write_text("one\ntw")                            # caught mid-write
    tail.poll(printer)
    assert printer.output == ["[rank 1] one"]
    with open(log, "a") as f:
        f.write("o\nthree")
    tail.poll(printer)
    tail.poll(printer, final=True)                       # the last line has no newline
    printer.line("Some torchrun log line", "stderr")
    assert printer.output == ["[rank 1] one", "[rank 1] two", "[rank 1] three"]
    assert printer.agent_log == ["Some torchrun log line"]
    assert capsys.readouterr().out == "[rank 1] one\n[rank 1] two\n[rank 1] three\n"
