"""Module 06's measured lab (labkit.labs.tp), its pictures (labkit.plots.tp) and `labkit bench tp`'s
figures.

Each part runs once (module fixtures), small (2 layers, h 64, 8 heads, 2 x 32 tokens): block,
dtensor, sp and pitfall on 2 gloo ranks, block with sequence parallelism on 4. Expected values
are computed here from the shapes, independently of the lab and labkit.comm: S = s*b*h*4 bytes
per collective (fp32), Megatron's 2 forward + 2 backward per layer, and transformers' Llama's
separate q, k, v, gate, up Linears (5 input-gradient all-reduces per layer in DTensor's plain
plan). No assertion is on speed.
"""
from __future__ import annotations

import pytest

from labkit.runtime.launch import run_lab

L, H, HEADS, S, B, V = 2, 64, 8, 32, 2, 256        # the lab's defaults
PAYLOAD = S * B * H * 4                             # one collective's S (fp32 activations)


def lab(part: str, nproc: int = 2, *extra: str) -> list:
    return run_lab("labkit.labs.tp", nproc=nproc, timeout=240, quiet=True,
                   args=["--part", part, "--steps", "2", *extra]).results


@pytest.fixture(scope="module")
def block2():
    return lab("block")


@pytest.fixture(scope="module")
def block4_sp():
    return lab("block", 4, "--sequence-parallel")


@pytest.fixture(scope="module")
def dtensor2():
    return lab("dtensor")


@pytest.fixture(scope="module")
def sp2():
    return lab("sp")


@pytest.fixture(scope="module")
def pitfall2():
    return lab("pitfall")


def calls(row: dict) -> dict:
    return {k: c for k, (c, _) in row.items()}


def test_block_equals_one_device_with_four_all_reduces_per_layer(block2):
    for r in block2:
        assert r["output_max_diff"] < 1e-4 and r["input_grad_max_diff"] < 1e-4
        assert r["weight_grad_max_diff"] < 1e-4
        # every parameter of the parallel layers was compared, shards and whole ones
        assert len(r["grad_max_diff"]) == L * 12        # 2 LayerNorms x 2 + 4 Linears x 2
        for layer in r["per_layer"]:
            assert calls(layer["forward"]) == {"all_reduce": 2}
            assert calls(layer["backward"]) == {"all_reduce": 2}
        assert r["collectives"] == {"all_reduce": [4 * L, 4 * L * PAYLOAD]}
        assert r["ratio_bytes"] == {"all_reduce": 1.0} and r["ratio_calls"] == {"all_reduce": 1.0}
        assert r["extra_kinds"] == [] and r["sequence_parallel_sync"] == {}


def test_block_sequence_parallel_on_4_ranks_gathers_and_scatters_the_same_bytes(block4_sp):
    assert [r["rank"] for r in block4_sp] == [0, 1, 2, 3]
    for r in block4_sp:
        assert r["output_max_diff"] < 1e-4 and r["input_grad_max_diff"] < 1e-4
        assert r["weight_grad_max_diff"] < 1e-4        # LayerNorms after their all-reduce
        for layer in r["per_layer"]:
            for phase in ("forward", "backward"):
                assert calls(layer[phase]) == {"all_gather": 2, "reduce_scatter": 2}
        assert r["collectives"] == {"all_gather": [4 * L, 4 * L * PAYLOAD],
                                    "reduce_scatter": [4 * L, 4 * L * PAYLOAD]}
        assert r["ratio_bytes"] == {"all_gather": 1.0, "reduce_scatter": 1.0}
        # what saw one sequence shard, summed once after backward: per layer the 2 LayerNorms'
        # weight and bias (2h each) and the 2 row-parallel biases added on the shard (h each)
        assert r["sequence_parallel_sync"] == {"all_reduce": [1, L * (2 * 2 * H + 2 * H) * 4]}


def test_dtensor_llama_loss_equals_one_process_and_counts_follow_the_plan(dtensor2):
    r0 = dtensor2[0]
    assert set(r0["loss_max_diff"]) == {"plain", "fused", "sp"}
    assert all(d < 1e-5 for d in r0["loss_max_diff"].values()), r0["loss_max_diff"]
    expected = {  # per layer: q, k, v, gate, up each all-reduce their input gradient (plain)
        "plain": ({"all_reduce": 2}, {"all_reduce": 5}),
        "fused": ({"all_reduce": 2}, {"all_reduce": 2}),
        "sp": ({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 2, "reduce_scatter": 2})}
    for plan, (fwd, bwd) in expected.items():
        p = r0["plans"][plan]
        assert p["predicted_per_layer"] == {"forward": fwd, "backward": bwd}
        for layer in p["layers"]:
            assert calls(layer["forward"]) == fwd and calls(layer["backward"]) == bwd
            assert all(b == c * PAYLOAD for ph in layer.values() for c, b in ph.values())
    plain, fused, sp = (r0["plans"][k] for k in ("plain", "fused", "sp"))
    assert plain["ratio_bytes"] == {"all_reduce": 7 / 4}
    assert fused["ratio_bytes"] == {"all_reduce": 1.0}
    assert sp["ratio_bytes"] == {"all_gather": 1.0, "reduce_scatter": 1.0}
    # outside the layers, with SP: the vocab-parallel embedding (reduce-scatter forward,
    # all-gather backward) and the head's input all-gather
    assert calls(sp["step"]) == {"all_gather": 4 * L + 2, "reduce_scatter": 4 * L + 1}
    # the norms' Partial gradients are all-reduced by the optimizer, h floats each
    assert {b // c for c, b in sp["optimizer"].values()} == {H * 4}


def test_sp_saves_activations_and_trades_no_bytes(sp2):
    r = sp2[0]
    for model, whole in (("llama", "fused"), ("blocks", "tp")):
        assert r[model]["sp"]["measured"] < r[model][whole]["measured"]
    # the hand-built blocks: all-gather + reduce-scatter put on the wire what all-reduce does
    assert r["blocks"]["sp"]["wire"] == r["blocks"]["tp"]["wire"] == 4 * L * PAYLOAD
    for row in r["llama"].values():      # the formula, plus what these plans keep whole
        assert row["ratio_kept_gathered"] == pytest.approx(1.0, abs=0.01)


def test_sp_blocks_match_megatron_formula_without_dropout(sp2):
    for row in sp2[0]["blocks"].values():          # LayerNorm's mean and rstd: < 1% beyond
        assert row["ratio_kept_gathered"] == pytest.approx(1.0, abs=0.01)


def test_pitfall_bare_all_gather_gives_wrong_input_gradients(pitfall2):
    for r in pitfall2:
        rows = r["rows"]
        assert r["wrong"] == ["dist.all_gather", "tdnn.all_gather"]
        bare = rows["dist.all_gather"]
        assert bare["output"] < 1e-6 and bare["weight_grad"] < 1e-5
        assert bare["input_grad"] > 100 * r["tolerance"]
        assert rows["tdnn.all_gather"]["weight_grad_ratio"] == pytest.approx(2.0)   # x tp
        for right in ("tdnn.all_gather, loss / tp, f", "gather (Megatron)"):
            assert max(rows[right]["input_grad"], rows[right]["weight_grad"]) < 1e-4


def test_check_degree_message_names_the_flag(capsys):
    from labkit.labs.tp import lab as tp

    args, parser = tp.parse_args(["--seq", "30"])
    with pytest.raises(SystemExit):
        tp.check_degree(parser, args, 4)
    err = capsys.readouterr().err
    assert "argument --seq: 30 does not divide over the 4 tensor-parallel ranks" in err
    assert "allowed: a multiple of 4" in err


def test_plots_draw_the_lab_reports(block2, dtensor2):
    from labkit.plots import png_bytes, tp

    rows = tp.collective_rows(block2[0])
    assert rows == {"all_reduce": (4 * L * PAYLOAD, 4 * L * PAYLOAD)}
    drows = tp.collective_rows(dtensor2[0])
    assert drows["plain: all_reduce"] == (7 * L * PAYLOAD, 4 * L * PAYLOAD)
    for fig in (tp.measured_bars(rows), tp.measured_bars(drows), tp.weight_split(4),
                tp.heads_per_rank(8, 4), tp.mlp_flow(2), tp.mlp_flow(4, sequence_parallel=True)):
        assert png_bytes(fig)[:4] == b"\x89PNG"


@pytest.mark.parametrize("call, message", [
    (lambda tp: tp.heads_per_rank(6, 4), "tp"),
    (lambda tp: tp.weight_split(3), "tp"),
    (lambda tp: tp.measured_bars({"a": (1, -1)}), "rows['a']"),
    (lambda tp: tp.collective_rows({"part": "sp"}), "report"),
])
def test_plots_refuse_bad_input(call, message):
    from labkit.plots import tp

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(tp)


def test_bench_summary(block2, dtensor2):
    from labkit.cli.bench_tp import summary

    s = summary(block2[0], dtensor2[0])
    for impl in ("block", "dtensor"):
        assert s[impl]["payload"] == s[impl]["predicted"] == 4 * L * PAYLOAD
        assert s[impl]["wire"] == 4 * L * PAYLOAD        # ring all-reduce on 2: 2(N-1)/N S = S
