"""The communication calculator and module 02's pictures, driven from plain pytest (no kernel):
set control values as a learner would; results follow labkit.comm; bad input is a message."""
from __future__ import annotations

import pytest

from labkit.comm import bytes_sent_per_rank, collective_time
from labkit.hardware import LINKS
from labkit.plots import png_bytes
from labkit.plots import comm as pc
from labkit.widgets.comm import CUSTOM, CommCalculator
from test_calculator_properties import type_into as _set



def test_defaults_follow_collective_time():
    calc = CommCalculator()
    link = LINKS["nvlink4"]
    want = collective_time("all_reduce", 1000e6, 8, link.bandwidth, link.latency)
    assert calc.error is None and calc.time == pytest.approx(want, rel=1e-12)
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    html = calc.result.value
    assert "bandwidth-bound" in html
    assert pc.fmt_size(bytes_sent_per_rank("all_reduce", 1000e6, 8)) in html
    # the link row shows per-direction, both directions and the vendor's words
    assert f"{link.bandwidth / 1e9:,.2f} GB/s" in html and f"{link.bidirectional / 1e9:,.2f} GB/s" in html
    assert "900 GB/s" in html


def test_controls_change_result_and_plot():
    calc = CommCalculator()
    html0, png0 = calc.result.value, bytes(calc.figure.value)
    _set(calc, ranks=64)
    assert calc.time == pytest.approx(collective_time("all_reduce", 1e9, 64, LINKS["nvlink4"].bandwidth,
                                                      LINKS["nvlink4"].latency))
    assert calc.result.value != html0 and bytes(calc.figure.value) != png0
    for name, value in [("op", "all_gather"), ("size_mb", 0.01), ("link", "eth-100g"),
                        ("algorithm", "ring")]:
        before = (calc.result.value, calc.time)
        calc.controls[name].value = value
        assert calc.error is None, (name, calc.error)
        if name != "algorithm":
            assert (calc.result.value, calc.time) != before, name
    # 10 kB over 100 GbE on 64 ranks: the latency term dominates
    assert "latency-bound" in calc.result.value


def test_custom_link_and_tree():
    calc = CommCalculator(link=CUSTOM, bandwidth_gbs=12.5, latency_us=10.0, ranks=16,
                          size_mb=256.0)
    assert calc.time == pytest.approx(collective_time("all_reduce", 256e6, 16, 12.5e9, 10e-6))
    assert "100.0 Gb/s" in calc.result.value          # 12.5 GB/s x 8 bits
    ring = calc.time
    _set(calc, algorithm="tree")
    assert calc.time == pytest.approx(collective_time("all_reduce", 256e6, 16, 12.5e9, 10e-6,
                                                      algorithm="tree"))
    assert calc.time != ring


@pytest.mark.parametrize("values,needle", [
    ({"ranks": 1}, "at least 2 ranks"),
    ({"ranks": 0}, "at least 2 ranks"),
    ({"size_mb": 0.0}, "message size"),
    ({"size_mb": -5.0}, "message size"),
    ({"link": CUSTOM, "bandwidth_gbs": -1.0}, "bandwidth"),
    ({"link": CUSTOM, "bandwidth_gbs": 0.0}, "bandwidth"),
    ({"link": CUSTOM, "latency_us": -2.0}, "latency"),
    ({"op": "all_gather", "algorithm": "tree"}, "tree"),
    ({"ranks": "2.5"}, "ranks N='2.5' is not a whole number"),
    ({"ranks": "1e3"}, "ranks N='1e3' is not a whole number"),
    ({"ranks": 10**8}, "ranks N=100000000 must be a whole number >= 1 and <= 1e7"),
    ({"size_mb": 1e300}, "message size S (MB)=1e+300 must be a number >= 1e-06 and <= 1e12"),
    ({"size_mb": float("inf")}, "message size S (MB)=inf must be a number >= 1e-06 and <= 1e12"),
    ({"size_mb": float("nan")}, "message size S (MB)=nan"),
    ({"link": CUSTOM, "bandwidth_gbs": float("inf")}, "custom bandwidth (GB/s per direction)=inf "
                                                     "must be a number >= 0.001 and <= 1e6"),
    ({"link": CUSTOM, "latency_us": float("nan")}, "custom latency (µs)=nan must be a number "
                                                   ">= 0 and <= 1e6"),
])
def test_bad_input_is_a_message(values, needle):
    calc = CommCalculator(**values)
    assert calc.time is None and needle in calc.error
    assert "labkit-error" in calc.result.value and "Traceback" not in calc.result.value
    # no image rather than an empty one (a browser draws that as a broken-image icon)
    assert calc.figure.value == b"" and calc.figure.layout.display == "none"
    assert len(calc.error) < 200                      # no 300-digit numbers


def test_the_largest_message_allowed_reads_as_numbers():
    calc = CommCalculator(size_mb=1e12)               # 1e18 bytes, the cost model's limit
    assert calc.error is None and "inf" not in calc.result.value and "nan" not in calc.result.value
    assert len(calc.result.value) < 5000


def test_recovers_after_bad_input():
    calc = CommCalculator(ranks=4)
    _set(calc, ranks=1)
    assert calc.time is None and "at least 2 ranks" in calc.result.value
    _set(calc, ranks=2)
    assert calc.error is None and calc.time > 0 and bytes(calc.figure.value).startswith(b"\x89PNG")
    assert calc.figure.layout.display != "none"


def test_unknown_initial_control():
    with pytest.raises(ValueError, match="unknown control"):
        CommCalculator(sizee=3)


def test_crossover_is_where_terms_meet():
    n, bw, lat = 8, 50e9, 5e-6
    s = pc.crossover_bytes("all_reduce", n, bw, lat)
    assert collective_time("all_reduce", s, n, 1e300, lat) == pytest.approx(
        collective_time("all_reduce", s, n, bw, 0.0))


def test_ring_steps_end_with_every_chunk_summed_everywhere():
    for n in (2, 3, 4, 8):
        steps = pc.ring_all_reduce_steps(n)
        assert len(steps) == 1 + 2 * (n - 1)
        everyone = frozenset(range(n))
        assert all(cell == everyone for row in steps[-1]["state"] for cell in row)
        # after reduce-scatter, rank r holds the full sum of chunk (r + 1) mod n
        rs_end = steps[n - 1]["state"]
        assert all(rs_end[r][(r + 1) % n] == everyone for r in range(n))
        # every step, every rank sends exactly one chunk to its right neighbour
        for st in steps[1:]:
            assert sorted(src for src, _, _ in st["sends"]) == list(range(n))
            assert all(dst == (src + 1) % n for src, dst, _ in st["sends"])
    with pytest.raises(ValueError):
        pc.ring_all_reduce_steps(1)


def test_figures_render():
    for fig in (pc.holdings_figure(), pc.holdings_figure("all_to_all", 3),
                pc.ring_steps_figure(4),
                pc.time_vs_size_figure("all_gather", 4, 25e9, 5e-6,
                                       measured={"measured": ([1e6, 1e7], [1e-4, 1e-3])}),
                pc.bench_figure([{"op": "all_reduce", "size": s, "time": 1e-4 + s / 1e9,
                                  "busbw": 1e9} for s in (1e3, 1e6)],
                                {"all_reduce": {"alpha": 1e-4, "beta": 1e-9}})):
        assert png_bytes(fig).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="allowed"):
        pc.holdings("gather")
