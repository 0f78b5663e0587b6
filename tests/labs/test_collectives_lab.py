"""Module 02's labs: the bandwidth sweep (labkit.labs.collectives) and the semantics demo
(labkit.labs.semantics). Pure helpers first; then one launch of each on 4 gloo ranks, shared by
every assertion about it. No assertion is on speed (the machine is shared)."""
from __future__ import annotations

import os

import pytest

from labkit.comm import bus_bandwidth, bytes_sent_per_rank, collective_time
from labkit.labs import collectives as lab
from labkit.plots.comm import holdings

N = 4


@pytest.mark.parametrize("text,value", [("1K", 1024), ("16M", 16 * 2**20), ("1G", 2**30),
                                        ("512", 512), ("4MiB", 4 * 2**20), ("64kb", 65536)])
def test_parse_size(text, value):
    assert lab.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "-1K", "lots", "3X"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        lab.parse_size(text)


def test_sweep_sizes_split_into_rank_chunks():
    sizes = lab.sweep_sizes(1000, 2**20, 4, world_size=3, elem_size=4)
    assert sizes == sorted(set(sizes)) and sizes[0] >= 1000 and sizes[-1] <= 2**20 + 12
    assert all(s % (3 * 4) == 0 for s in sizes)
    with pytest.raises(ValueError):
        lab.sweep_sizes(10, 5, 2, 4, 4)
    with pytest.raises(ValueError):
        lab.sweep_sizes(10, 50, 1, 4, 4)


def test_fit_recovers_a_line_and_reads_as_the_ring_model():
    alpha, beta = 150e-6, 1 / 2e9
    sizes = [2**k for k in range(10, 25, 2)]
    fit = lab.fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert fit["beta"] == pytest.approx(beta, rel=1e-9)
    assert fit["rms_rel_err"] < 1e-9
    for op in lab.OPS:
        m = lab.model_parameters(op, N, fit)
        # the model with these parameters reproduces the fitted line
        for s in (1e3, 1e7):
            assert collective_time(op, s, N, m["bandwidth"], m["latency"]) == pytest.approx(
                alpha + beta * s, rel=1e-9)
    with pytest.raises(ValueError, match="two or more"):
        lab.fit_alpha_beta([1024, 1024], [1.0, 2.0])


def test_table_row_format():
    row = dict(op="all_reduce", size=1048576, count=262144, type="float32", redop="sum",
               time=1e-3, algbw=1048576 / 1e-3, busbw=bus_bandwidth("all_reduce", 1048576, 1e-3, 4),
               wrong=0, sent=1.5 * 1048576)
    line = lab.format_row(row)
    assert line.split() == ["1048576", "262144", "float32", "sum", "1000.0", "1.049", "1.573",
                            "0", "1.500"]
    assert "size" in lab.HEADER and "busbw" in lab.HEADER


def test_count_column_is_nccl_tests_count_argument():
    # nccl-tests prints the call's count: all_gather's per-rank input (sendcount) and
    # reduce_scatter's per-rank output (recvcount), S / N elements; all_reduce's whole buffer
    S = 2**28
    assert lab.nccl_count("all_reduce", S, 4, 8) == 2**26
    assert lab.nccl_count("all_gather", S, 4, 8) == 2**23
    assert lab.nccl_count("reduce_scatter", S, 4, 8) == 2**23


def test_bench_entry_is_discovered():
    from labkit.cli import bench
    from labkit.cli import bench_collectives
    assert bench.benchmarks()["collectives"] is bench_collectives.main
    assert "labkit bench collectives" in bench_collectives.__doc__


# ---------------------------------------------------------------------------------------------
# one launch of each lab

@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from labkit.runtime.launch import run_lab
    plot = tmp_path_factory.mktemp("bench") / "coll.png"
    return run_lab("labkit.labs.collectives", nproc=N, timeout=180, quiet=True,
                   args=["--sizes", "4K,1M,2M", "-n", "2", "-w", "1", "--plot", str(plot)])


@pytest.mark.multirank
def test_sweep_table_and_fit(sweep):
    res = sweep.results[0]
    rows, fits = res["rows"], res["fits"]
    assert res["world_size"] == N and res["backend"] == "gloo"
    assert [r["op"] for r in rows] == [op for op in lab.OPS for _ in range(3)]
    assert all(r["wrong"] == 0 for r in rows)
    for r in rows:
        assert r["algbw"] == pytest.approx(r["size"] / r["time"])
        assert r["busbw"] == pytest.approx(bus_bandwidth(r["op"], r["size"], r["time"], N))
    assert set(fits) == set(lab.OPS)
    assert all(f["steps"] > 0 and "bandwidth" in f for f in fits.values())
    assert os.path.getsize(res["plot"]) > 0 and open(res["plot"], "rb").read(4) == b"\x89PNG"
    text = "\n".join(sweep.output)
    assert "busbw" in text and "# fit all_reduce" in text and "Out of bounds values : 0 OK" in text


@pytest.mark.multirank
def test_sweep_bytes_sent_by_gloo(sweep):
    """What gloo writes to its sockets at >= 1 MiB: the ring figures for all_reduce and
    all_gather, and 2(N-1)/N S for reduce_scatter, because gloo runs it as an all_reduce."""
    rows = sweep.results[0]["rows"]
    for r in rows:
        if r["size"] < 2**20:
            continue
        ring = bytes_sent_per_rank(r["op"], r["size"], N)
        gloo = bytes_sent_per_rank("all_reduce", r["size"], N) if r["op"] == "reduce_scatter" else ring
        assert r["sent"] == pytest.approx(gloo, rel=0.01), r
        # every rank sends the same
        for rank in range(N):
            assert sweep.results[rank]["sent"][rows.index(r)] == pytest.approx(gloo, rel=0.01)


@pytest.fixture(scope="module")
def semantics():
    from labkit.runtime.launch import run_lab
    return run_lab("labkit.labs.semantics", nproc=N, timeout=120, quiet=True)


def _numbers(cells, op, rank_input):
    """The numbers a row of symbolic cells stands for (None for an empty cell)."""
    out = []
    for cell in cells:
        if not cell:
            return None
        total = None
        for r, c in cell:
            v = rank_input(r) if c < 0 else [10.0 * r + c]
            total = v if total is None else [a + b for a, b in zip(total, v)]
        out.extend(total)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("op", ["broadcast", "reduce", "all_reduce", "all_gather",
                                "reduce_scatter", "all_to_all", "send_recv"])
def test_pictures_show_what_real_ranks_hold(semantics, op):
    """The who-holds-what picture of each collective is what the 4 ranks reported."""
    def rank_input(r):
        return [10.0 * r] if op == "all_gather" else [10.0 * r + j for j in range(N)]

    before, after = holdings(op, N)
    for rank in range(N):
        got = semantics.results[rank][op]
        for cells, key in ((before, "before"), (after, "after")):
            want = _numbers(cells[rank], op, rank_input)
            if want is not None:                  # empty cells: undefined, not compared
                assert got[key] == want, (op, rank, key)


# ---------------------------------------------------------------------------------------------
# bad flags, refused before the sweep

@pytest.mark.parametrize("plot, says", [
    ("DIR", "--plot: 'DIR' is a folder; allowed: a file path such as 'DIR/collectives.png'"),
    ("DIR/missing/c.png", "--plot: the folder 'DIR/missing' does not exist; allowed: a file"),
    ("DIR/f/c.png", "--plot: 'DIR/f' is a file, not a folder"),
    ("/proc/c.png", "--plot: no file can be written in '/proc'"),
])
def test_plot_path_is_checked_before_the_sweep(capsys, tmp_path, plot, says):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        lab.main(["--sizes", "4K", "--plot", plot.replace("DIR", str(tmp_path))])
    assert says.replace("DIR", str(tmp_path)) in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["-f", "1"], "--step-factor: 1.0 is not > 1; allowed: a number > 1"),
    (["-b", "1M", "-e", "1K"], "--max-bytes: 1K is below --min-bytes 1M"),
])
def test_sweep_flags_are_checked_before_the_sweep(capsys, argv, says):
    with pytest.raises(SystemExit):
        lab.main([*argv, "--plot", ""])
    assert says in capsys.readouterr().err


@pytest.mark.multirank
def test_a_folder_as_plot_fails_at_once_through_the_launcher(tmp_path):
    from labkit.runtime.launch import LabError, run_lab

    with pytest.raises(LabError) as info:
        run_lab("labkit.labs.collectives", nproc=2, timeout=120, quiet=True,
                args=["--sizes", "4K", "--plot", str(tmp_path)])
    text = str(info.value)
    assert f"--plot: {str(tmp_path)!r} is a folder" in text and "Traceback" not in text
    assert not any("all_reduce" in line for line in info.value.result.output)   # no sweep
