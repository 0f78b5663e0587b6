"""The course map: one source for the README, the welcome notebook and `labkit course`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Module:
    number: str
    notebook: str
    title: str
    outcome: str
    minutes: int  # a rough time for a first pass: reading, running the labs, the exercises


MODULES = (
    Module("00", "00_welcome", "welcome", "run `labkit doctor`, launch a first 2-rank lab, know how grading works", 20),
    Module("01", "01_memory_math", "memory math", "count params of real architectures, break down training memory, measure it", 90),
    Module("02", "02_collectives", "collectives", "use all-reduce / all-gather / reduce-scatter, write ring all-reduce, measure busbw", 90),
    Module("03", "03_ddp", "DDP", "build DDP from scratch (naive -> bucketed -> overlapped), compare with torch DDP", 90),
    Module("04", "04_zero", "ZeRO", "build ZeRO-1/2/3, measure per-rank memory and communication against the formulas", 120),
    Module("05", "05_fsdp", "FSDP", "FSDP2 `fully_shard` on a transformers model, wrapping, "
           "mixed precision, checkpoints; nodes that meet or don't, and three recoveries from a "
           "dead rank (relaunch, elastic restart, torchft)", 100),
    Module("06", "06_tensor_parallel", "tensor parallelism", "Megatron column/row parallel by hand, then DTensor; sequence parallelism", 120),
    Module("07", "07_pipeline_parallel", "pipeline parallelism", "schedules and bubbles up to ZB-V and DualPipeV, GPipe by hand, torch.distributed.pipelining, a schedule of your own", 120),
    Module("08", "08_3d_parallelism", "3D parallelism", "DeviceMesh, TP+FSDP, PP+DP, a planner for real clusters, case studies", 120),
    Module("09", "09_interview_prep", "interview prep", "answer numeric questions fast, design a 70B run, diagnose a slow run", 60),
    Module("10", "10_mixture_of_experts", "mixture of experts", "count MoE models exactly, route and balance tokens, expert parallelism by all-to-all, size an MoE run", 120),
    Module("11", "11_reading_a_run", "reading a run", "read exposed communication, the straggler and the bubble off profiler traces; FP8's error measured; torch.compile with DDP and FSDP2", 90),
)


def repo_root() -> Path:
    """The checkout that holds notebooks/ (labkit is installed editable from it)."""
    return Path(__file__).resolve().parents[2]


def notebook_path(module: Module, root: Path | None = None) -> Path:
    return (root or repo_root()) / "notebooks" / f"{module.notebook}.ipynb"


def available(root: Path | None = None) -> list[Module]:
    """The modules whose notebook exists in this checkout."""
    return [m for m in MODULES if notebook_path(m, root).exists()]


def total_minutes() -> int:
    return sum(m.minutes for m in MODULES)
