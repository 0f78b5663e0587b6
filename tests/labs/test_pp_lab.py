"""Module 07's measured lab (labkit.labs.pp), its pictures (labkit.plots.pp) and `labkit bench pp`'s
figures.

Each part runs once (module fixtures) on 4 gloo ranks at the lab's defaults (Llama from config,
8 layers, h 64, m = 8 micro-batches of 1 x 32 tokens, 0.03 s sleep per stage forward). Expected
values are computed here from the shapes, independently of the lab and labkit.pipeline: the
peak micro-batches a stage holds (GPipe m; 1F1B p - r; interleaved Megatron-LM's warm-up
2 (p - r - 1) + (v - 1) p chunk forwards plus one, over v), the sends of each rank (a virtual
stage sends forward unless last and backward unless first, once per micro-batch), the idle
share in closed form (p - 1)/(m + p - 1). Timing (of the least disturbed of 5 steps, of up to 3
runs: `check_idle_agrees`): the measured idle share is asserted within
5 points of the simulator's at the measured costs (labkit.labs.common.pipeline: compute plus the
framework's per-op overhead, p2p net of it) for GPipe, 1F1B and interleaved, by hand and
torch's; zero-bubble, whose W torch places elsewhere than the simulator, within 10; never more
than 3 below (stalls only add idle time). Seen with a CPU burner beside the 4 ranks on 2 cores:
within 3 points (torch's had been 5 to 11 above before the overhead was modelled).
"""
from __future__ import annotations

import pytest

from labkit.runtime.launch import run_lab

P, M, V, S, H = 4, 8, 2, 32, 64
MSG = 1 * S * H * 4                     # one micro-batch's activation (fp32) between stages
TOLERANCE_POINTS = {"zero-bubble": 10}     # else 5


def lab(part: str, nproc: int = P, *extra: str) -> dict:
    return run_lab("labkit.labs.pp", nproc=nproc, timeout=240, quiet=True,
                   args=["--part", part, *extra]).results


@pytest.fixture(scope="module")
def byhand():
    return lab("byhand")


@pytest.fixture(scope="module")
def torch_part():
    return lab("torch")


@pytest.fixture(scope="module")
def ppdp():
    return lab("ppdp", 4, "--steps", "2")


def peaks(schedule: str, p: int = P, m: int = M, v: int = V) -> list[float]:
    if schedule == "gpipe":
        return [float(m)] * p
    if schedule == "interleaved-1f1b":
        return [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) / v for r in range(p)]
    return [float(min(p - r, m)) for r in range(p)]


def sends(p: int, m: int, v: int = 1) -> list[list[int]]:
    last = p * v - 1
    out = []
    for r in range(p):
        count = m * sum((k != last) + (k != 0) for k in range(r, last + 1, p))
        out.append([count, count * MSG])
    return out


def check_timeline(row: dict, schedule: str, v: int = 1) -> None:
    """What a step's timeline must show whatever the load: the closed form, the measured idle
    share never well below the simulation (stalls only add idle time), every op of every stage.
    How close above it comes is `check_idle_agrees`'s."""
    k = {"interleaved-1f1b": V, "zero-bubble": 3}.get(schedule, 1)   # zero-bubble: f = b = w
    assert row["idle_formula"] == pytest.approx((P - 1) / (k * M + P - 1))
    assert row["idle_measured"] > row["idle_simulated"] - 0.03, (
        schedule, row["idle_measured"], row["idle_simulated"])
    kinds = {(e["stage"], e["kind"]) for e in row["events"]}
    assert kinds == {(s, k) for s in range(P) for k in ("FBW" if schedule == "zero-bubble"
                                                         else "FB")}
    assert len(row["events"]) == P * M * v * (3 if schedule == "zero-bubble" else 2)


def excess_points(row: dict) -> list[float]:
    """Each measured step's idle share above its simulation, in points (the lab's repeats)."""
    return [100 * (x["idle_measured"] - x["idle_simulated"]) for x in row["repeats"]]


def check_idle_agrees(report: dict, rerun, runs: int = 3) -> None:
    """The measured idle share is within TOLERANCE_POINTS (else 5) of the simulation at the
    measured costs, for the least disturbed step: other work on shared cores stalls ranks (a
    stall adds idle time, or lengthens the op costs the simulation is priced at), so the step
    closest to its simulation is the schedule's own (timeit's rule, applied to the quantity
    compared; issue 28, item 14: the shortest step of one run was 5.3 points above under load
    8-15). When no step of this run agrees, the part runs again (`rerun()`, up to `runs` runs
    in all) and every step counts; a simulation that is wrong misses on every step."""
    import os

    seen = {name: excess_points(row) for name, row in report["schedules"].items()}

    def off() -> dict:
        closest = {name: min(points, key=abs) for name, points in seen.items()}
        return {name: x for name, x in closest.items()
                if not abs(x) < TOLERANCE_POINTS.get(name, 5)}
    for _ in range(runs - 1):
        if not off():
            return
        for name, row in rerun()["schedules"].items():
            seen[name] += excess_points(row)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    closest = {n: round(x, 1) for n, x in off().items()}
    every = {n: [round(x, 1) for x in v] for n, v in seen.items()}
    assert not closest, (
        f"idle share minus the simulation's, in points, of the step closest to it in {runs} "
        f"runs: {closest}; every step: {every}; load average {load} on {os.cpu_count()} cores "
        "(a machine this busy stalls every step)")


def test_idle_agreement_takes_the_least_disturbed_step_and_says_what_it_saw():
    def report(*excess):
        return {"schedules": {"gpipe": {"repeats": [
            dict(idle_measured=0.3 + x / 100, idle_simulated=0.3) for x in excess]}}}

    check_idle_agrees(report(7, 3, 9), rerun=lambda: pytest.fail("ran again"))  # one step agrees
    again = []
    check_idle_agrees(report(7, 8), rerun=lambda: again.append(1) or report(6, 2))
    assert again == [1]
    with pytest.raises(AssertionError, match="'gpipe': 6.0.* every step: .*load average"):
        check_idle_agrees(report(7, 8), rerun=lambda: report(6, 9))   # wrong on every step


def test_byhand_loss_order_peaks_and_idle(byhand):
    r = byhand[0]
    for name in ("gpipe", "1f1b"):
        row = r["schedules"][name]
        assert row["loss_diff"] < 1e-5 and row["grad_max_diff"] < 1e-5
        assert row["same_order"] and row["stages_out_of_order"] == []
        assert row["peak_in_flight"] == peaks(name)
        assert row["predicted_in_flight"] == peaks(name)
        assert row["p2p_sent"] == [c for c, _ in sends(P, M)]
        check_timeline(row, name)
    check_idle_agrees(r, lambda: lab("byhand")[0])


def test_torch_schedules_loss_order_peaks_and_sends(torch_part):
    r = torch_part[0]
    assert list(r["schedules"]) == ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
    for name, row in r["schedules"].items():
        v = V if name == "interleaved-1f1b" else 1
        assert row["loss_diff"] < 1e-5 and row["grad_max_diff"] < 1e-5, name
        assert row["peak_in_flight"] == peaks(name), name
        assert row["sends"] == sends(P, M, v), name
        assert row["ratio_sends"] == [1.0, 1.0]
        # torch executes the simulator's order; zero-bubble's simulated order is chosen greedily
        # from the measured costs, so it may differ from run to run (its W are placed elsewhere)
        if name != "zero-bubble":
            assert row["same_order"] and row["same_order_without_w"], name
        check_timeline(row, name, v)
    check_idle_agrees(r, lambda: lab("torch")[0])


def test_ppdp_fsdp2_works_and_ddp_static_graph_drifts_silently(ppdp):
    rows = ppdp[0]["variants"]
    fsdp = rows["fsdp2"]
    assert fsdp["error"] is None and fsdp["steps_done"] == 2 and fsdp["replicas_agree"]
    assert max(fsdp["loss_diff"]) < 1e-5
    # one gradient reduction per step on every rank, not one per micro-batch
    assert [c["reduce_scatter"][0] for c in fsdp["reductions"]] == [1, 1, 1, 1]
    static = rows["ddp static_graph"]
    assert static["error"] is None and not static["replicas_agree"]
    assert static["replica_checksum_diff"][-1] > 1e-3
    # the last stage's replicas (ranks 2, 3) never all-reduce; the first stage's do, once
    assert ["all_reduce" in c for c in static["reductions"]] == [True, True, False, False]
    ddp = rows["ddp"]
    assert ddp["replicas_agree"] and max(ddp["loss_diff"]) < 1e-5
    assert [c["all_reduce"][0] for c in ddp["reductions"]] == [1, 1, 1, 1]
    busiest = max(c["all_reduce"][1] for c in ddp["reductions"])
    assert busiest == ppdp[0]["predicted_ddp_all_reduce"][1]


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_beside_charges_the_per_op_overhead_and_counts_it_idle(schedule, v):
    """A step whose stages spend `o` between ops (torch's sends, receives, loss) and compute f,
    b: beside() finds o, and its simulation has this step's length and idle share."""
    from labkit.labs.common import pipeline as common
    from labkit.pipeline import idle_share, simulate

    f, b, o = 0.03, 0.06, 0.004
    run = simulate(schedule, P, M, fwd=f + v * o, bwd=b + v * o, chunks=v)
    events = [dict(stage=e.stage, kind=e.kind, microbatch=e.microbatch, chunk=e.chunk,
                   start=e.start, end=e.end - o) for e in run.events]     # o after each op
    row = common.beside(schedule, events, P, M, v)
    assert row["overhead_s"] == pytest.approx(o) and row["p2p_s"] == pytest.approx(0, abs=1e-9)
    assert row["fwd_s"] == pytest.approx(f) and row["bwd_s"] == pytest.approx(b)
    assert row["step_simulated"] == pytest.approx(row["step_measured"])
    assert row["idle_measured"] == pytest.approx(idle_share(events, P))
    assert abs(row["difference_points"]) < 1e-6 and row["same_order"]
    assert row["idle_measured"] > row["idle_formula"] + 0.02     # the overhead is idle time


def test_check_sizes_messages_name_the_flag(capsys):
    from labkit.labs.pp import lab as pp

    for argv, world, message in (
            (["--part", "torch", "--layers", "6"], 4, "argument --layers: 6 does not split "
                                                      "into 8 equal stages"),
            (["--part", "torch", "--microbatches", "6"], 4, "argument --microbatches: 6 is not "
                                                            "a multiple of the 4 stages"),
            (["--part", "ppdp"], 2, "--part ppdp runs pp 2 x dp 2: 2 ranks given"),
            (["--microbatches", "2"], 4, "argument --microbatches: 2 is fewer than the 4")):
        args, parser = pp.parse_args(argv)
        with pytest.raises(SystemExit):
            pp.check_sizes(parser, args, world)
        err = capsys.readouterr().err
        assert message in err and "allowed:" in err


def test_plots_draw_measured_beside_simulated(torch_part):
    from labkit.pipeline import idle_share, simulate
    from labkit.plots import png_bytes, pp

    row = torch_part[0]["schedules"]["interleaved-1f1b"]
    sim = simulate("interleaved-1f1b", P, M, chunks=V)
    fig = pp.beside(row["events"], sim)
    assert png_bytes(fig)[:4] == b"\x89PNG"
    top, bottom = fig.axes[:2]
    assert top.get_xlim() == bottom.get_xlim()          # the same time scale
    assert f"{100 * idle_share(row['events'], P):.1f}%" in top.get_title()
    assert "15.8%" in bottom.get_title()                # 3 / 19 of the step
    assert png_bytes(pp.gantt(simulate("zero-bubble", P, M)))[:4] == b"\x89PNG"


@pytest.mark.parametrize("events, message", [
    ([], "events=\\[\\] has no event"),
    ([{"stage": 0, "kind": "X", "microbatch": 0, "start": 0, "end": 1}], "kind='X'"),
    ([{"stage": 0, "kind": "F", "microbatch": 0, "start": 2, "end": 1}], "end before start"),
    ([{"stage": 0}], "is not an Event"),
])
def test_plots_refuse_bad_events(events, message):
    from labkit.plots import pp

    with pytest.raises(ValueError, match=message):
        pp.gantt(events)


def test_bench_summary(byhand, torch_part):
    from labkit.cli.bench_pp import summary

    rows = summary(byhand[0], torch_part[0])
    assert [(r["impl"], r["schedule"]) for r in rows] == [
        ("by hand", "gpipe"), ("by hand", "1f1b"), ("torch", "gpipe"), ("torch", "1f1b"),
        ("torch", "interleaved-1f1b"), ("torch", "zero-bubble")]
    for r in rows:
        assert r["step_s"] > 0 and r["step_simulated_s"] > 0
        assert r["difference_points"] == pytest.approx(
            100 * (r["idle_measured"] - r["idle_simulated"]))
        assert r["idle_ratio"] == pytest.approx(r["idle_measured"] / r["idle_simulated"])
    with pytest.raises(ValueError, match="--part byhand, torch or custom"):
        summary({"part": "ppdp"})
