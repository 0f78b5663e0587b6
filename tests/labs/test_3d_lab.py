"""Module 08's measured lab (labkit.labs.threed): the mesh's groups, TP + FSDP2, PP x FSDP2,
pp x dp x tp on 8 ranks, ring attention.

Each part runs once (module fixtures), at the lab's defaults (4 layers, h 64, 8 heads, 4 KV
heads, vocabulary 256, 2 x 32 tokens, 2 micro-batches, 2 AdamW steps). Expected values are
computed here from the shapes: the rank layout (TP innermost), parameter counts, S = b s h x 4
bytes, K/V blocks of 2 b (s/cp) kv_size x 4 bytes. No assertion is on speed.
"""
from __future__ import annotations

import pytest

from labkit.runtime.launch import run_lab

L, H, HEADS, KV, V, S, B, M = 4, 64, 8, 4, 256, 32, 2, 2
D = H // HEADS
FFN = 2 * H
SHARDED = 2 * H * H + 2 * H * KV * D + 3 * H * FFN      # q, o, k, v, gate/up/down per layer
REPLICATED = 2 * H                                      # the two RMSNorms per layer
VOCAB = V * H                                           # one of embedding / head


def lab(part: str, nproc: int) -> list:
    return run_lab("labkit.labs.threed", nproc=nproc, timeout=300, quiet=True,
                   args=["--part", part]).results


@pytest.fixture(scope="module")
def mesh4():
    return lab("mesh", 4)


@pytest.fixture(scope="module")
def mesh8():
    return lab("mesh", 8)


@pytest.fixture(scope="module")
def two_d():
    return lab("2d", 4)


@pytest.fixture(scope="module")
def ppdp():
    return lab("ppdp", 4)


@pytest.fixture(scope="module")
def three_d():
    return lab("3d", 8)


def test_mesh_groups_put_tp_innermost_and_all_reduce_reaches_the_group(mesh4, mesh8):
    want4 = {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
    want8 = {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
             "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    for results, want in ((mesh4, want4), (mesh8, want8)):
        for r in results:
            assert r["all_equal"]
            for axis, groups in want.items():
                a = r["axes"][axis]
                assert a["groups_from_mesh"] == groups == a["groups_formula"]
                mine = next(g for g in groups if r["rank"] in g)
                assert a["all_reduce_ranks"] == mine == a["my_group"]


def per_rank_params(tp: int, dp: int, layers: int, vocab_matrices: int, tp_vocab: bool,
                    final_norm: bool) -> float:
    """Parameters one rank holds: layers TP-split then FSDP-split; vocab matrices split over
    dp (and tp when the plan splits them)."""
    vocab = vocab_matrices * VOCAB / (tp if tp_vocab else 1)
    return (layers * (SHARDED / tp + REPLICATED) + vocab + (H if final_norm else 0)) / dp


def test_2d_loss_memory_and_collectives_per_axis(two_d):
    held = per_rank_params(2, 2, L, 2, tp_vocab=True, final_norm=True)
    for r in two_d:
        assert r["loss_max_diff"] < 1e-5
        st = r["states"]
        assert st["measured"] == {"params": 4 * held, "grads": 4 * held,
                                  "optimizer_states": 8 * held}
        assert st["ratio"] == {"params": 1.0, "grads": 1.0, "optimizer_states": 1.0}
        c = r["collectives"]
        # 4 per layer (Megatron), the embedding's forward and the head input's backward
        # all-reduce, and the logits gathered whole for the loss
        assert c["tp"] == {"all_reduce": [4 * L + 2, (4 * L + 2) * B * S * H * 4],
                           "all_gather": [1, B * S * V * 4]}
        assert c["dp"]["all_gather"][0] == 2 * L + 1 and c["dp"]["reduce_scatter"][0] == L + 1
        assert set(c) == {"tp", "dp"}
        exact = {"tp": {"all_reduce": 1.0, "all_gather": 1.0},
                 "dp": {"all_gather": 1.0, "reduce_scatter": 1.0}}
        assert r["ratio_calls"] == exact and r["ratio_bytes"] == exact


@pytest.mark.parametrize("which", ["ppdp", "three_d"])
def test_pipeline_parts_match_one_process_and_replicas_agree(which, request):
    results = request.getfixturevalue(which)
    tp = 2 if which == "three_d" else 1
    assert len(results) == 4 * tp
    for r in results:
        assert r["loss_max_diff"] < 1e-5
        assert r["replica_checksum_diff"] == 0.0 and r["max_param_diff"] < 1e-4
        first = r["stage"] == 0
        held = per_rank_params(tp, 2, L // 2, 1, tp_vocab=True, final_norm=not first)
        assert r["states"]["measured"]["params"] == 4 * held
        assert r["states"]["ratio"] == {"params": 1.0, "grads": 1.0, "optimizer_states": 1.0}
        pp = r["collectives"]["pp"]
        assert pp["send"][0] == M and pp["recv"][0] == M     # activations out, grads in
        assert pp["send"][1] == M * B * S * H * 4
        assert ("tp" in r["collectives"]) == (tp > 1)
        if tp > 1:      # per micro-batch: 4 per layer of the stage, + the embedding (stage 0) or
            want = {"all_reduce": [(4 * L // 2 + 1) * M, (4 * L // 2 + 1) * M * B * S * H * 4]}
            if not first:           # the head's backward, and its logits gathered whole
                want["all_gather"] = [M, M * B * S * V * 4]
            assert r["collectives"]["tp"] == want
    stages = [r["checksums"] for r in results][0]
    assert len(set(stages)) == 2                     # one checksum per stage, all replicas equal


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention_with_the_formula_s_messages(cp):
    for r in lab("cp", cp):
        assert max(r["max_diff"].values()) < 1e-5
        block = 2 * B * (S // cp) * KV * D * 4
        assert r["messages"]["forward"]["send"] == [cp - 1, (cp - 1) * block]
        assert r["ratio_sends"]["forward"] == [1.0, 1.0]


@pytest.mark.parametrize("argv, nproc, message", [
    (["--part", "3d"], 4, "--part 3d runs on 8 ranks, not 4"),
    (["--part", "2d", "--heads", "6", "--hidden", "96"], 4, "argument --heads: 6 does not"),
    (["--part", "cp"], 3, "--part cp runs on 2 or 4 ranks, not 3"),
])
def test_bad_sizes_are_refused_naming_the_argument(argv, nproc, message, capsys):
    from labkit.labs.threed import check_world, parse_args

    args, p = parse_args(argv)
    with pytest.raises(SystemExit):
        check_world(p, args, nproc)
    assert message in capsys.readouterr().err


def test_mesh_figure_colours_groups_and_names_the_link():
    from labkit.plots import mesh as mesh_plot

    tp = [[8 * i + j for j in range(8)] for i in range(16)]              # 16 nodes x 8 GPUs
    dp = [[r + 8 * k for k in range(8)] for r in list(range(8)) + list(range(64, 72))]
    pp = [[r, r + 64] for r in range(64)]
    fig = mesh_plot.mesh_figure({"tp": tp, "dp": dp, "pp": pp}, gpus_per_node=8)
    titles = [ax.get_title() for ax in fig.axes]
    assert "NVLink" in titles[0] and "network" in titles[1] and "network" in titles[2]
    assert len(fig.axes[0].patches) == 128 + 16                           # ranks + node outlines
    small = mesh_plot.mesh_figure({"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}, 2)
    assert [t.get_text() for t in small.axes[0].texts] == ["0", "1", "2", "3"]
    assert mesh_plot.link_of([[0, 1], [2, 3]], 2).startswith("NVLink")
    assert mesh_plot.link_of([[0, 2], [1, 3]], 2).startswith("network")


@pytest.mark.parametrize("groups, message", [
    ({}, "must be a non-empty dict"),
    ({"tp": [[0, 1], [1, 2]]}, "groups['tp'] must cover ranks 0 to world - 1 once each"),
    ({"tp": [[0, 1]], "dp": [[0, 2], [1, 3]]}, "covers 4 ranks but another axis 2"),
])
def test_mesh_figure_refuses_bad_groups(groups, message):
    from labkit.plots import mesh as mesh_plot

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mesh_plot.mesh_figure(groups)


def test_bench_row_reads_the_lab_report():
    from labkit.cli.bench_3d import row

    r = {"degrees": "pp2 x dp2 x cp1 x tp2 = 8 ranks", "step_s": 0.5, "loss_max_diff": 1e-7,
         "states": {"measured": {"params": 4, "grads": 4, "optimizer_states": 8},
                    "ratio": {"params": 1.0}}}
    assert row(r) == dict(degrees="pp2 x dp2 x cp1 x tp2", step_s=0.5, loss_diff=1e-7,
                          state_bytes=16, ratio=1.0)
