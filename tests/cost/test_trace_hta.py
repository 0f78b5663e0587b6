"""labkit.trace beside Holistic Trace Analysis (HTA 0.5.0, `hta`; skipped where not installed).

On the shipped CPU (gloo) course traces HTA parses every event (same names, counts and step) but
its analyses are of GPU kernels only: no kernel, so overlap is NaN, the kernel breakdown empty,
the temporal breakdown an IndexError; asserted, so a future HTA that reads CPU traces is
noticed. Its durations are whole microseconds (ts and end floored, overlaps cut by 1 us): per op
name the sums agree within 2 us an event. On a crafted GPU trace (known NCCL/compute overlap)
its overlap share, kernel breakdown and idle time equal labkit.trace's up to HTA's rounding of
percentages to 0.01 (labkit: 1 - exposed/comm, unions of intervals, as HTA merges them).
"""
from __future__ import annotations

import collections
import json
import logging
import shutil
from pathlib import Path

import pytest

from labkit import trace

hta = pytest.importorskip("hta.trace_analysis")
pytestmark = [pytest.mark.filterwarnings("ignore:The inplace keyword"),       # HTA on pandas 3
              pytest.mark.filterwarnings("ignore:invalid value encountered")]  # its NaN overlap

SHIPPED = Path(__file__).parents[2] / "labkit" / "data" / "traces"
US = 1e-6


def analysis(folder):
    logging.getLogger("hta").setLevel(logging.ERROR)
    return hta.TraceAnalysis(trace_dir=str(folder))


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    """HTA over the shipped 2-rank torch DDP traces (a folder of them, as HTA wants)."""
    folder = tmp_path_factory.mktemp("ddp")
    files = sorted(SHIPPED.glob("ddp-torch-rank*.json"))
    assert len(files) == 2, files
    for f in files:
        shutil.copy(f, folder)
    return analysis(folder), {r: folder / f.name for r, f in enumerate(files)}


def test_hta_reads_the_events_labkit_reads(cpu):
    a, files = cpu
    sym = a.t.symbol_table.get_sym_table()
    assert sorted(a.t.traces) == sorted(files)        # ranks from distributedInfo
    for rank, path in files.items():
        df = a.t.get_trace(rank)
        names = df["name"].map(lambda i: sym[i])
        mine = [e for e in trace.load(path)]
        count, total = collections.Counter(), collections.defaultdict(float)
        for e in mine:
            count[e["name"]] += 1
            total[e["name"]] += e["dur"]
        assert collections.Counter(names) == count
        theirs = df.groupby(names)["dur"].sum()
        for name, n in count.items():
            assert abs(theirs[name] - total[name]) <= 2 * n, (rank, name)
        assert a.get_profiler_steps() == trace.steps(path)


def test_hta_finds_nothing_to_analyse_in_cpu_traces(cpu):
    """All of HTA's breakdowns look at GPU kernels (events on a stream), which gloo traces lack;
    labkit.trace gives these traces communication and exposed time (checked in tests/labs)."""
    a, files = cpu
    overlap = a.get_comm_comp_overlap(visualize=False)
    assert overlap["comp_comm_overlap_pctg"].isna().all(), overlap
    kinds, kernels = a.get_gpu_kernel_breakdown(visualize=False)
    assert kinds.empty and kernels.empty
    with pytest.raises(IndexError):
        a.get_temporal_breakdown(visualize=False)
    for path in files.values():
        assert trace.summarize(path).comm_s > 0


COMPUTE = [(0, 100), (150, 250), (300, 400)]                # us, stream 7
COMM = {20: [(50, 200), (380, 500)], 21: [(60, 120)]}      # NCCL kernels on two streams
NCCL, GEMM = "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ampere_sgemm_128x64_nn"


def gpu_trace() -> dict:
    """One rank, one ProfilerStep, each kernel launched by a cudaLaunchKernel (correlation)."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1,
               "tid": 1, "ts": 1000, "dur": 600}]
    kernels = [(GEMM, 7, s) for s in COMPUTE]
    kernels += [(NCCL, st, s) for st, ss in COMM.items() for s in ss]
    for k, (name, stream, (a, b)) in enumerate(kernels, 1):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                       "tid": 1, "ts": 1000 + k, "dur": 1, "args": {"correlation": k}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
                       "ts": 1010 + a, "dur": b - a,
                       "args": {"stream": stream, "correlation": k, "device": 0}})
    return {"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
            "traceEvents": events}


def test_gpu_overlap_breakdown_and_idle_agree_with_hta(tmp_path):
    """By hand: communication covers [50, 200) and [380, 500), 270 us; under compute 50+50+20
    = 120 us, so 150 us exposed; compute 300 us; kernels span 500 us, idle 50 us."""
    data = gpu_trace()
    (tmp_path / "rank0.json").write_text(json.dumps(data))
    a = analysis(tmp_path)
    mine = trace.summarize(data)
    assert (mine.gpu, mine.comm_s, mine.exposed_comm_s, mine.compute_s) == pytest.approx(
        (True, 270 * US, 150 * US, 300 * US))
    pctg = a.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0]
    assert pctg == pytest.approx(100 * (1 - mine.exposed_comm_s / mine.comm_s), abs=0.006)
    kinds, _ = a.get_gpu_kernel_breakdown(visualize=False)
    got = dict(zip(kinds["kernel_type"], kinds["sum"]))
    hidden = mine.comm_s - mine.exposed_comm_s
    assert got == pytest.approx({"COMMUNICATION": mine.exposed_comm_s / US,
                                 "COMPUTATION": (mine.compute_s - hidden) / US,
                                 "COMPUTATION overlapping COMMUNICATION": hidden / US})
    kernels = trace.summarize([e for e in data["traceEvents"] if e["cat"] == "kernel"])
    idle = a.get_temporal_breakdown(visualize=False)["idle_time(us)"].iloc[0]
    assert idle == pytest.approx(kernels.idle_s / US)
