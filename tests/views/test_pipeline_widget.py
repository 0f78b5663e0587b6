"""The pipeline calculator, typed into as a learner would: results follow labkit.pipeline, the
Gantt chart has the stages, F/B/W colours and micro-batch numbers, bad input is a message
naming the field; then every control driven with anything (tests/test_calculator_properties)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from labkit.pipeline import (V_SCHEDULES, activation_memory, bubble_formula, p2p_messages,
                             paper_bubble, simulate)
from labkit.plots import png_bytes
from labkit.plots.pipeline import COLOURS, gantt, side_by_side
from labkit.widgets.pipeline import MAX_OPS, ZB_MAX_STAGES, PipelineCalculator
from test_calculator_properties import (PROPERTY, _checked_png, _raises_value_error,
                                        _shows_one_state, _text, drive,
                                        start_or_name_the_control, type_into)

CONTROLS = ("schedule", "stages", "microbatches", "chunks", "fwd", "bwd", "wgrad", "p2p",
            "model", "batch_size", "seq_len")


@pytest.fixture(scope="module", autouse=True)
def quick_figures():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("labkit.widgets.pipeline.png_bytes", _checked_png)
        yield


def check_pipeline(calc: PipelineCalculator) -> None:
    _shows_one_state(calc.result.value, calc.figure, calc.error)
    if calc.error is None:
        kw = calc.inputs()
        want = simulate(**kw)
        assert calc.pipeline.events == want.events and calc.pipeline.makespan == want.makespan
        p, m, v = kw["stages"], kw["microbatches"], kw["chunks"]
        assert calc.formula == bubble_formula(kw["schedule"], p, m, v)
        assert calc.in_flight == want.peak_in_flight
        assert calc.messages == p2p_messages(p, m, v, v_shape=kw["schedule"] in V_SCHEDULES)
        shown = _text(calc.result.value)
        assert f"{100 * want.bubble_fraction:,.1f} %" in shown
    else:
        assert calc.pipeline is None and calc.formula is None and calc.activations is None
        # the calculator's own caps first: past them the simulator itself would run (up to
        # minutes for the largest shapes: this test took 206 s once on a loaded machine)
        assert calc.error.startswith("stages x micro-batches x chunks") \
            or f"allowed: 1 to {ZB_MAX_STAGES}" in calc.error \
            or _raises_value_error(lambda: [simulate(**calc.inputs()), calc._memory(
                calc.inputs())])


def test_defaults_four_stages_eight_microbatches():
    calc = PipelineCalculator()
    check_pipeline(calc)
    shown = " ".join(_text(calc.result.value).split())
    # 1F1B, p=4, m=8: 3/11 of the step idle, 3/8 relative to the ideal, as the formula says
    assert "27.3 % of the step idle (37.5 % relative" in shown
    assert "equal to the simulation" in shown
    assert calc.in_flight == [4.0, 3.0, 2.0, 1.0] and calc.activations is None
    assert calc.controls["chunks"].layout.display == "none"
    assert calc.controls["wgrad"].layout.display == "none"


def test_typing_reaches_the_simulator():
    calc = PipelineCalculator()
    type_into(calc, schedule="interleaved-1f1b", stages="4", microbatches="8", chunks="2",
              fwd=1.0, bwd=2.0)
    check_pipeline(calc)
    assert calc.controls["chunks"].layout.display == ""
    assert calc.formula[1] == pytest.approx(3 / 16)             # (p - 1)/(v m)
    type_into(calc, p2p=0.5)
    check_pipeline(calc)
    assert "the simulation differs: sends take time" in _text(calc.result.value)
    type_into(calc, schedule="zero-bubble", p2p=0.0, bwd=1.0, wgrad=1.0, microbatches="8")
    check_pipeline(calc)
    assert calc.controls["wgrad"].layout.display == "" and calc.pipeline.chunks == 1
    assert calc.pipeline.makespan == pytest.approx(3 * 8 + 3)  # m(f+b+w) + (p-1)(f+b-w)
    assert "equal to the simulation" in _text(calc.result.value)


@pytest.mark.parametrize("schedule, bubble, peak", [("zbv", 1.5, 8), ("dualpipev", 3.0, 9)])
def test_v_schedules_are_offered_with_the_papers_bubble(schedule, bubble, peak):
    """zbv and dualpipev: two chunks a rank (no chunks control), W shown, the papers' bubble
    inside a rank's span beside the simulation; p=4, m=8, f=b=w=1 ms."""
    calc = PipelineCalculator(schedule=schedule, bwd=1.0, wgrad=1.0)
    check_pipeline(calc)
    assert calc.controls["chunks"].layout.display == "none"
    assert calc.controls["wgrad"].layout.display == ""
    assert calc.pipeline.chunks == 2 and calc.pipeline.makespan - calc.pipeline.ideal == bubble
    shown = " ".join(_text(calc.result.value).split())
    said = paper_bubble(schedule, 4, 1.0, 1.0, 1.0)
    assert f"{said:,.3f} ms idle inside the busiest rank's span; simulated: {said:,.3f} ms" in shown
    assert f"peak {peak} micro-batch chunks on a rank" in shown
    assert "equal to the simulation" in shown
    type_into(calc, microbatches="6")
    if schedule == "dualpipev":
        assert calc.error.startswith("micro-batches m=6 is fewer than the 8 stages of dualpipev")
    else:
        assert calc.error is None
    check_pipeline(calc)


def test_activation_memory_per_stage_for_a_model():
    calc = PipelineCalculator(model="llama2-7b", seq_len=2048, batch_size=2, schedule="gpipe")
    check_pipeline(calc)
    want = activation_memory("llama2-7b", "gpipe", 4, 8, batch_size=2, seq_len=2048)
    assert calc.activations == want
    assert f"{want[0] / 1e9:,.3f} GB" in _text(calc.result.value)
    type_into(calc, schedule="1f1b")
    assert calc.activations[0] == pytest.approx(want[0] / 2)   # 4 in flight instead of 8
    type_into(calc, model="gpt2", seq_len="4096")
    assert calc.error.startswith("seq length=4096 exceeds the 1024 learned positions of gpt2")
    check_pipeline(calc)


@pytest.mark.parametrize("values, start", [
    ({"stages": "2.5"}, "stages p='2.5' is not a whole number"),
    ({"microbatches": "0"}, "micro-batches m=0 must be a whole number >= 1"),
    ({"schedule": "interleaved-1f1b", "microbatches": "6"},
     "micro-batches m=6 must be a multiple of stages p=4"),
    ({"fwd": 0.0}, "forward (ms)=0.0 must be a number >= 1e-06"),
    ({"p2p": -1.0}, "p2p send (ms)=-1.0 must be a number >= 0"),
    ({"stages": "64", "microbatches": "128"},
     f"stages x micro-batches x chunks = 8,192 is more than this calculator simulates and "
     f"draws at each change ({MAX_OPS:,})"),
    ({"schedule": "zero-bubble", "stages": "128", "microbatches": "8"},
     "stages p=128 is more than this calculator simulates for zero-bubble"),
    ({"stages": str(10**30)}, "stages p=1e30 must be a whole number >= 1 and <= 1,024"),
    ({"model": "gpt2", "stages": "16"}, "stages p=16 is larger than num_layers=12"),
    ({"model": "gpt2", "schedule": "interleaved-1f1b", "chunks": "4"},
     "p x v = 16 virtual stages is more than num_layers=12"),
])
def test_bad_input_is_a_message(values, start):
    calc = PipelineCalculator()
    type_into(calc, **values)
    assert calc.error is not None and calc.error.startswith(start), calc.error
    check_pipeline(calc)
    type_into(calc, schedule="1f1b", stages="4", microbatches="8", fwd=1.0, p2p=0.0,
              model="none")
    assert calc.error is None                                   # and it recovers
    check_pipeline(calc)


def test_unknown_or_unoffered_starting_values_are_messages():
    with pytest.raises(ValueError, match="unknown control"):
        PipelineCalculator(tp=8)
    with pytest.raises(ValueError, match=r"^schedule='pipedream' is not offered; allowed: "):
        PipelineCalculator(schedule="pipedream")


def test_the_real_gantt_chart_has_stages_colours_and_microbatch_numbers():
    import labkit.widgets.pipeline as wp
    drawn = []
    wp.png_bytes, saved = (lambda fig: drawn.append(fig) or png_bytes(fig, dpi=40)), wp.png_bytes
    try:
        calc = PipelineCalculator(schedule="zero-bubble", bwd=1.0, wgrad=1.0)
    finally:
        wp.png_bytes = saved
    assert bytes(calc.figure.value).startswith(b"\x89PNG")
    ax = drawn[-1].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {i}" for i in range(4)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "weight grad"]
    numbers = sorted(int(t.get_text()) for t in ax.texts)
    assert numbers == sorted(e.microbatch for e in calc.pipeline.events)    # one per bar
    colours = {tuple(round(x, 3) for x in c.get_facecolor()[0][:3]) for c in ax.collections}
    assert len(colours) == len(COLOURS) == 3


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_gantt_of_a_v_schedule_tells_chunks_apart_and_shows_w(schedule):
    r = simulate(schedule, 4, 8, fwd=1.0, bwd=1.0, wgrad=1.0)
    ax = gantt(r).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {i}" for i in range(4)]
    assert ax.get_title().startswith(f"{schedule}, p=4 ranks (8 stages in a V), m=8")
    drawn = [(c.get_label(), c.get_hatch()) for c in ax.collections]
    # chunk 0 plain and in the legend, chunk 1 hatched: F, B and W of each
    assert {name for name, hatch in drawn if not hatch} == {"forward", "backward", "weight grad"}
    assert [name for name, hatch in drawn if hatch] == ["_chunk 1"] * 3
    assert sum(len(c.get_paths()) for c in ax.collections) == len(r.events)


def test_measured_events_beside_the_simulation():
    sim = simulate("gpipe", 4, 8, fwd=0.01, bwd=0.02)
    measured = [dict(stage=e.stage, kind=e.kind, microbatch=e.microbatch, chunk=0,
                     start=e.start + 0.003, end=e.end + 0.003) for e in sim.events]
    fig = side_by_side(sim, measured)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("simulated: gpipe, p=4, m=8: 27.3 %")
    assert titles[1] == "measured: 27.3 % of the step idle"
    assert png_bytes(gantt(measured), dpi=20).startswith(b"\x89PNG")


def test_every_control_is_driven_below():
    assert sorted(PipelineCalculator().controls) == sorted(CONTROLS)


FEWER = settings(PROPERTY, max_examples=25)


@FEWER
@given(data=st.data())
def test_pipeline_calculator_shows_a_result_or_a_message(data):
    start = data.draw(st.sampled_from([{}, {"schedule": "interleaved-1f1b"},
                                       {"schedule": "zero-bubble"}, {"schedule": "zbv"},
                                       {"schedule": "dualpipev"}, {"model": "gpt2"}]))
    calc = PipelineCalculator(**start)
    weights = dict.fromkeys(CONTROLS, 1)
    weights.update({n: 3 for n in ("stages", "microbatches", "chunks", "fwd", "bwd")})
    drive(data, calc, check_pipeline, weights)


@FEWER
@given(data=st.data())
def test_a_starting_value_gives_a_calculator_or_a_message_naming_the_control(data):
    start_or_name_the_control(data, PipelineCalculator, CONTROLS, check_pipeline)
