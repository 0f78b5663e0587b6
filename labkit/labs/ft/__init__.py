"""torchft lab: fault tolerance without stopping the job. A lighthouse and 2 replica groups train
the same model; one group is killed with SIGKILL mid-step, the other carries on alone, and the
killed group restarts and heals from its peer's memory.

    python -m labkit.labs.ft                                  # 30 steps, group 1 killed in step 8
    python -m labkit.labs.ft --steps 40 --kill-at 10 --step-seconds 0.5
    measure(steps=30, kill_at=8, step_seconds=0.3)            # from a notebook: the figures

Parts: lab.py (the driver: groups, kill, restart), group.py (one replica group: what each
group's ranks run), lighthouse.py, figures.py. Linux x86-64 only (torchft's wheels).
"""
from labkit.labs.ft.lab import main, measure, parse_args, unavailable

__all__ = ["main", "measure", "parse_args", "unavailable"]
