"""Plan.compare and parse_layout: why a given layout ranks where it does, part by part."""
from __future__ import annotations

import subprocess
import sys

import pytest

from labkit.planner import PARTS, Layout, parse_layout, plan


@pytest.fixture(scope="module")
def small():
    return plan("llama3.2-1b", 16, gpu="h100-sxm", global_batch=256, seq_len=4096)


@pytest.mark.parametrize("layout", [
    Layout(), Layout(tp=8, pp=16, dp=128, sharding="fsdp", chunks=2, sequence_parallel=True,
                     recompute="full"),
    Layout(tp=2, cp=4, dp=2, sharding="zero1", micro_batch=4, recompute="selective"),
])
def test_a_layouts_text_reads_back_as_the_layout(layout):
    assert parse_layout(str(layout)) == layout


@pytest.mark.parametrize("text, message", [
    ("tp=8 turbo", "'turbo' is not understood; allowed: tp=, pp=, dp=, cp=, b=, v="),
    ("tp=eight", "'tp=eight' needs a whole number"),
    ("tp=0", "layout.tp"),
    ("", "must be text such as"),
])
def test_bad_layout_text_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("=", "=")):
        parse_layout(text)


def test_the_best_compares_as_rank_one_with_nothing_to_explain(small):
    c = small.compare(small.best.layout)
    assert c.rank == 1 and all(d == 0 for d in c.differences().values())
    assert "as fast as the best" in c.text()


def test_a_slower_layout_is_explained_by_its_parts(small):
    slow = small.ranked[len(small.ranked) // 2]
    c = small.compare(str(slow.layout))
    assert 1 < c.rank <= small.ranked.index(slow) + 1
    assert set(c.differences()) == set(PARTS)
    total = sum(c.differences().values())
    assert total == pytest.approx(slow.step_time - small.best.step_time)
    worst = max(c.differences(), key=c.differences().get)
    assert f"mostly {worst} (+" in c.text()


def test_a_layout_that_does_not_fit_says_so(small):
    c = small.compare(Layout(dp=16, micro_batch=16))
    assert c.rank is None and "does not fit" in c.text()


def test_labkit_plan_compare_prints_the_comparison():
    out = subprocess.run([sys.executable, "-m", "labkit", "plan", "llama3.2-1b", "--gpus", "16",
                          "--global-batch", "256", "--seq-len", "4096", "--top", "1",
                          "--compare", "tp=2+sp dp=8 zero1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tp=2+sp pp=1 dp=8 cp=1 zero1 b=1 recompute=none:" in out.stdout
    assert "this-best" in out.stdout and "slower by" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "labkit", "plan", "llama3.2-1b", "--gpus", "16",
                          "--compare", "tp=2 bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'bogus' is not understood" in bad.stderr
