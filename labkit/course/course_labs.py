"""Every lab run the course's notebooks make (module, lab, ranks, arguments), in course order,
and `select_labs`, which picks them by name for `labkit workshop check` ("ddp" is every ddp run,
"ddp:compare" one, "05" a module, "all" everything; runs that read another's checkpoints pull it
in).
"""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class LabRun:
    """One run_lab call of a course notebook. `{tmp}` in args is a folder of this preflight's
    own (checkpoints); `needs`: runs that must come first (they write what this one reads);
    `fails`: the run is meant to fail (the crash of module 05's resume lesson)."""
    name: str
    module: str            # "05" (notebooks/05_*.ipynb)
    lab: str               # a module of labkit.labs
    nproc: int
    args: tuple[str, ...] = ()
    preflight: bool = False     # one run per lab program: what `workshop check` runs by default
    quick: bool = False         # what `workshop check --quick` runs
    needs: tuple[str, ...] = ()
    fails: bool = False


_CKPT = ("--steps", "8", "--save-every", "2")
# module 05's relaunch (labkit.labs.elastic.measure): the killed run, then a new one that resumes
# (its in-place restart, max_restarts=1, and torchft's driver are not run_lab calls of this kind)
_ELASTIC = ("--steps", "10", "--save-every", "3", "--step-seconds", "0.3")
_COLL = ("--sizes", "4K,64K,512K,2M,8M", "-n", "3", "-w", "1", "--plot", "")

# Every run_lab of notebooks/, with the notebook's own arguments (module 09 launches none; the
# %%torchrun cells of 00, 02 and 03 run a few lines inline and are left out).
COURSE_LABS: tuple[LabRun, ...] = (
    LabRun("hello", "00", "hello", 2, (), preflight=True, quick=True),
    LabRun("memory", "01", "memory", 1, (), preflight=True, quick=True),
    LabRun("memory:llama", "01", "memory", 1, ("--model", "debug-llama")),
    LabRun("memory:fp32", "01", "memory", 2, ("--precision", "fp32")),
    LabRun("semantics", "02", "semantics", 4, (), preflight=True, quick=True),
    LabRun("collectives", "02", "collectives", 4, _COLL, preflight=True),
    LabRun("ddp:sampler", "03", "ddp", 4, ("--part", "sampler", "--samples", "10")),
    LabRun("ddp:compare", "03", "ddp", 2, ("--part", "compare"), preflight=True),
    LabRun("ddp:flags", "03", "ddp", 2, ("--part", "flags", "--steps", "2")),
    LabRun("ddp:straggler", "03", "ddp", 2, ("--part", "straggler", "--sleep", "0.05")),
    LabRun("zero", "04", "zero", 4, (), preflight=True),
    LabRun("fsdp:compare", "05", "fsdp", 4, ("--part", "compare"), preflight=True),
    LabRun("fsdp:timeline", "05", "fsdp", 4, ("--part", "timeline")),
    LabRun("fsdp:options", "05", "fsdp", 4, ("--part", "options")),
    LabRun("fsdp:options-gpt2", "05", "fsdp", 4, ("--part", "options", "--model", "gpt2")),
    LabRun("fsdp:fsdp1", "05", "fsdp", 2, ("--part", "fsdp1")),
    LabRun("dcp:save", "05", "dcp", 4, ("--part", "save"), preflight=True),
    LabRun("dcp:async", "05", "dcp", 4, ("--part", "async")),
    LabRun("dcp:export", "05", "dcp", 4, ("--part", "export")),
    LabRun("dcp:reshard", "05", "dcp", 4, ("--part", "reshard", "--ckpt-dir", "{tmp}/reshard")),
    LabRun("dcp:reshard-2", "05", "dcp", 2, ("--part", "reshard", "--ckpt-dir", "{tmp}/reshard"),
           needs=("dcp:reshard",)),
    LabRun("checkpoint", "05", "checkpoint", 4, (*_CKPT, "--ckpt-dir", "{tmp}/clean"),
           preflight=True),
    LabRun("checkpoint:crash", "05", "checkpoint", 4,
           (*_CKPT, "--ckpt-dir", "{tmp}/run", "--crash-at-step", "5"), fails=True),
    LabRun("checkpoint:resume", "05", "checkpoint", 4,
           (*_CKPT, "--ckpt-dir", "{tmp}/run", "--resume"), needs=("checkpoint:crash",)),
    LabRun("elastic:crash", "05", "elastic", 2, (*_ELASTIC, "--ckpt-dir", "{tmp}/elastic",
                                                 "--kill-at-step", "6", "--kill-rank", "1"),
           preflight=True, fails=True),
    LabRun("elastic:resume", "05", "elastic", 2, (*_ELASTIC, "--ckpt-dir", "{tmp}/elastic"),
           needs=("elastic:crash",)),
    LabRun("tp:block-2", "06", "tp", 2, ("--part", "block"), preflight=True),
    LabRun("tp:block-4", "06", "tp", 4, ("--part", "block")),
    LabRun("tp:dtensor", "06", "tp", 2, ("--part", "dtensor")),
    LabRun("tp:sp", "06", "tp", 2, ("--part", "sp")),
    LabRun("tp:pitfall", "06", "tp", 2, ("--part", "pitfall")),
    LabRun("pp:byhand", "07", "pp", 4, ("--part", "byhand"), preflight=True),
    LabRun("pp:torch", "07", "pp", 4, ("--part", "torch", "--schedules", "all")),
    LabRun("pp:ppdp", "07", "pp", 4, ("--part", "ppdp")),
    LabRun("threed:mesh", "08", "threed", 4, ("--part", "mesh"), preflight=True),
    LabRun("threed:2d", "08", "threed", 4, ("--part", "2d")),
    LabRun("threed:ppdp", "08", "threed", 4, ("--part", "ppdp")),
    LabRun("threed:3d", "08", "threed", 8, ("--part", "3d")),
    LabRun("threed:cp", "08", "threed", 2, ("--part", "cp")),
    LabRun("moe", "10", "moe", 4, ("--steps", "60"), preflight=True),
    LabRun("ddp:trace", "11", "ddp", 2, ("--part", "compare", "--trace", "{tmp}/traces")),
    LabRun("compile:ddp", "11", "compile", 2, ("--part", "ddp"), preflight=True),
    LabRun("compile:fsdp", "11", "compile", 2, ("--part", "fsdp", "--layers", "2", "--backend", "aot_eager")),
    LabRun("compile:order", "11", "compile", 2, ("--part", "order")),
)
_BY_NAME = {r.name: r for r in COURSE_LABS}


def select_labs(spec: str | None = None, quick: bool = False) -> list[LabRun]:
    """The runs `spec` names, in course order, with what they need first. spec: None (one run
    per lab program, or the --quick subset), "all", or comma-separated names: a run
    ("ddp:compare"), a lab ("ddp": its every run) or a module ("05")."""
    if spec is None or not spec.strip():
        chosen = [r for r in COURSE_LABS if (r.quick if quick else r.preflight)]
    elif spec.strip() == "all":
        chosen = list(COURSE_LABS)
    else:
        names = set()
        for word in (w.strip() for w in spec.split(",")):
            hits = [r.name for r in COURSE_LABS if word in (r.name, r.lab, r.module)]
            if not word or not hits:
                labs = sorted({r.lab for r in COURSE_LABS})
                raise ValueError(
                    f"labs={spec!r}: {word!r} is not a course lab; allowed: 'all', a lab "
                    f"({', '.join(labs)}), a module (00 to 10) or a run "
                    f"({', '.join(r.name for r in COURSE_LABS if ':' in r.name)})")
            names.update(hits)
        chosen = [r for r in COURSE_LABS if r.name in names]
    wanted = {r.name for r in chosen}
    todo = list(wanted)
    while todo:                       # add what the chosen runs read
        for need in _BY_NAME[todo.pop()].needs:
            if need not in wanted:
                wanted.add(need)
                todo.append(need)
    return [r for r in COURSE_LABS if r.name in wanted]
