"""How long each lab run of the course takes on a 2-core laptop: the one table of them.

    expected_seconds("labkit.labs.pp", 4, ["--part", "torch", "--schedules", "all"])   # 40.2

Measured by `labkit workshop check --labs all` (warm pool started, best of 2 runs) on a 2-core
x86 VM, 24 GiB, no GPU, torch 2.13.0+cpu, gloo, other jobs sharing the cores (load 3 to 8):
upper bounds for an idle laptop. The README's "Time per lab" table shows these numbers; a run is
named as in labkit.course.course_labs (tests/runtime/test_progress.py keeps the three in step).
`labkit.runtime.progress` shows them beside a running lab.
"""
from __future__ import annotations

import os

# Flags whose value names a file or folder: they do not change how long a run takes.
PATH_FLAGS = frozenset({"--plot", "--ckpt-dir"})
# Flags whose value names a folder but whose presence changes the run (--trace profiles more
# steps): kept as (flag, "DIR") whatever the folder.
PRESENCE_FLAGS = frozenset({"--trace"})
_CKPT = ("--steps", "8", "--save-every", "2", "--ckpt-dir", "")
_ELASTIC = ("--steps", "10", "--save-every", "3", "--step-seconds", "0.3", "--ckpt-dir", "")

# (run, lab of labkit.labs, ranks, arguments, seconds): CPU wall time of the run, best of 2
LAB_TIMES: tuple[tuple[str, str, int, tuple[str, ...], float], ...] = (
    ("hello", "hello", 2, (), 0.2),
    ("memory", "memory", 1, (), 5.0),
    ("memory:llama", "memory", 1, ("--model", "debug-llama"), 4.1),
    ("memory:fp32", "memory", 2, ("--precision", "fp32"), 1.1),
    ("semantics", "semantics", 4, (), 0.3),
    ("collectives", "collectives", 4,
     ("--sizes", "4K,64K,512K,2M,8M", "-n", "3", "-w", "1", "--plot", ""), 1.5),
    ("ddp:sampler", "ddp", 4, ("--part", "sampler", "--samples", "10"), 0.5),
    ("ddp:compare", "ddp", 2, ("--part", "compare"), 6.8),
    ("ddp:flags", "ddp", 2, ("--part", "flags", "--steps", "2"), 29.9),
    ("ddp:straggler", "ddp", 2, ("--part", "straggler", "--sleep", "0.05"), 1.4),
    ("zero", "zero", 4, (), 5.2),
    ("fsdp:compare", "fsdp", 4, ("--part", "compare"), 4.0),
    ("fsdp:timeline", "fsdp", 4, ("--part", "timeline"), 1.5),
    ("fsdp:options", "fsdp", 4, ("--part", "options"), 17.4),
    ("fsdp:options-gpt2", "fsdp", 4, ("--part", "options", "--model", "gpt2"), 28.1),
    ("fsdp:fsdp1", "fsdp", 2, ("--part", "fsdp1"), 2.7),
    ("dcp:save", "dcp", 4, ("--part", "save"), 2.7),
    ("dcp:async", "dcp", 4, ("--part", "async"), 3.3),
    ("dcp:export", "dcp", 4, ("--part", "export"), 2.8),
    ("dcp:reshard", "dcp", 4, ("--part", "reshard", "--ckpt-dir", ""), 2.8),
    ("dcp:reshard-2", "dcp", 2, ("--part", "reshard", "--ckpt-dir", ""), 2.7),
    ("checkpoint", "checkpoint", 4, _CKPT, 3.8),
    ("checkpoint:crash", "checkpoint", 4, (*_CKPT, "--crash-at-step", "5"), 2.5),
    ("checkpoint:resume", "checkpoint", 4, (*_CKPT, "--resume"), 2.8),
    ("elastic:crash", "elastic", 2, (*_ELASTIC, "--kill-at-step", "6", "--kill-rank", "1"), 3.2),
    ("elastic:resume", "elastic", 2, _ELASTIC, 3.9),
    ("tp:block-2", "tp", 2, ("--part", "block"), 0.6),
    ("tp:block-4", "tp", 4, ("--part", "block"), 0.9),
    ("tp:dtensor", "tp", 2, ("--part", "dtensor"), 2.3),
    ("tp:sp", "tp", 2, ("--part", "sp"), 1.5),
    ("tp:pitfall", "tp", 2, ("--part", "pitfall"), 0.4),
    ("pp:byhand", "pp", 4, ("--part", "byhand"), 13.2),
    ("pp:torch", "pp", 4, ("--part", "torch", "--schedules", "all"), 40.2),
    ("pp:ppdp", "pp", 4, ("--part", "ppdp"), 8.9),
    ("threed:mesh", "threed", 4, ("--part", "mesh"), 0.7),
    ("threed:2d", "threed", 4, ("--part", "2d"), 4.7),
    ("threed:ppdp", "threed", 4, ("--part", "ppdp"), 3.4),
    ("threed:3d", "threed", 8, ("--part", "3d"), 8.1),
    ("threed:cp", "threed", 2, ("--part", "cp"), 0.5),
    ("moe", "moe", 4, ("--steps", "60"), 21.3),
    ("ddp:trace", "ddp", 2, ("--part", "compare", "--trace", ""), 7.3),
    ("compile:ddp", "compile", 2, ("--part", "ddp"), 8.0),
    ("compile:fsdp", "compile", 2, ("--part", "fsdp", "--layers", "2", "--backend", "aot_eager"), 3.6),
    ("compile:order", "compile", 2, ("--part", "order"), 10.3),
)


def lab_name(target) -> str:
    """"pp" for "labkit.labs.pp" (or "pp"), "slow_print.py" for a script path."""
    text = os.fspath(target)
    if text.endswith(".py") or os.sep in text:
        return os.path.basename(text)
    return text.removeprefix("labkit.labs.")


def arg_key(args) -> frozenset:
    """A run's arguments as a set of (flag, value) pairs (value None for a bare flag), without
    the PATH_FLAGS: the same run whatever the order of its flags or the files it writes."""
    args = [str(a) for a in args]
    pairs, i = set(), 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) and not _is_flag(args[i + 1]) else None
        if flag in PRESENCE_FLAGS:
            pairs.add((flag, "DIR"))
        elif flag not in PATH_FLAGS:
            pairs.add((flag, value))
        i += 1 if value is None else 2
    return frozenset(pairs)


def _is_flag(word: str) -> bool:
    try:
        float(word)                 # -1, -0.5: a value
        return False
    except ValueError:
        return word.startswith("-")


_BY_KEY = {(lab, nproc, arg_key(args)): seconds for _, lab, nproc, args, seconds in LAB_TIMES}


def expected_seconds(target, nproc: int, args=()) -> float | None:
    """Seconds the course's run of `target` on `nproc` ranks with `args` takes on a 2-core
    laptop, or None for a run the course does not make (other ranks or arguments)."""
    return _BY_KEY.get((lab_name(target), nproc, arg_key(args)))
