"""Shared test set-up: tiers are marked (multirank, notebook, server, gpu, slow); GPU tests skip
cleanly without CUDA; fixture notebooks are data, never collected by nbval."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
collect_ignore_glob = ["fixtures/*", "lab_server.py"]

# CI runs property tests on fixed examples: a run that passes passes again (locally hypothesis
# keeps exploring new examples, which is how bugs are found).
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # hypothesis is a dev extra
    pass

# Ranks started by tests share 2 cores: one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The grader's judges (expected values from a run of the solutions, labkit.course.judge) are
# kept per template and labkit in the test session's cache, shared by its workers.
os.environ.setdefault("LABKIT_JUDGE_CACHE", str(ROOT / ".pytest_cache" / "labkit-judge"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The longest test files (seconds of one full run, measured with --junitxml), longest first.
# `make test` hands whole files to its 2 workers in collection order (--dist loadfile): started
# first, the long ones cannot be what one worker still runs alone at the end.
LONGEST_FIRST = (
    "course/test_grading.py", "course/test_grading_shortcuts.py", "lessons/test_05_fsdp.py",
    "runtime/test_faults.py", "lessons/test_07_pipeline_parallel.py",
    "course/test_grading_seal.py", "views/test_planner_widget.py",
    "lessons/test_11_reading_a_run.py", "runtime/test_blame.py", "runtime/test_multinode.py",
    "labs/test_elastic_lab.py", "lessons/test_08_3d_parallelism.py",
    "course/test_calculators_kernels.py", "labs/test_pp_lab.py", "labs/test_ft_lab.py",
    "labs/test_moe_exercise.py", "labs/test_interview_exercise.py",
)


def _file_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)          # stable: every file's own order is kept
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(params=["pool", "torchrun"])
def launcher(request):
    """Each test that takes it runs once per lab launcher."""
    return request.param


@pytest.fixture
def mark():
    """A fresh mark for a test's processes (proctools.MARK); none may be alive when it ends."""
    from proctools import processes_marked

    value = uuid.uuid4().hex
    yield value
    assert processes_marked(value) == [], "processes of the lab survived it"
