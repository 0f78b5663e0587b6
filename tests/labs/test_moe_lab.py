"""Module 10's lab (labkit.labs.moe): a transformers Mixtral whose MoE blocks run
expert-parallel by hand on 4 gloo ranks, against one process.

One 4-rank run of every part (60 training steps for the balance part: about 30 s once the warm
pool has imported transformers) is shared by the assertions. Figures asserted: what load
cannot change (losses, gradients, bytes, counts; the balance run is deterministic on CPU).
"""
from __future__ import annotations

import pytest

from labkit.labs import moe as lab
from labkit.runtime.launch import LabError, run_lab


@pytest.fixture(scope="module")
def run():
    return run_lab("labkit.labs.moe", nproc=4, timeout=300, quiet=True, args=["--steps", "60"])


@pytest.fixture(scope="module")
def runs(run):
    return run.results


@pytest.mark.multirank
def test_the_output_shows_every_part_and_no_warning(run):
    text = "\n".join(run.output)
    for word in ("parity, EP 4 x EDP 1", "parity, EP 2 x EDP 2", "balance, aux 0,",
                 "capacity factor 1.25", "time per step"):
        assert word in text, word
    assert "Warning" not in text, text


@pytest.mark.multirank
def test_expert_parallel_mixtral_equals_one_process(runs):
    for rank, r in enumerate(runs):
        for case in r["parity"]:
            # labkit's MoE blocks equal transformers' Mixtral blocks, and EP equals both
            assert case["loss_reference"] == pytest.approx(case["loss_transformers"], abs=1e-5)
            assert case["loss"] == pytest.approx(case["loss_reference"], abs=1e-5)
            assert case["max_grad_diff"]["dense"] < 1e-6, (rank, case)
            assert case["max_grad_diff"]["experts"] < 1e-6, (rank, case)
        assert [(c["ep"], c["edp"]) for c in r["parity"]] == [(4, 1), (2, 2)]


@pytest.mark.multirank
def test_all_to_all_bytes_are_the_cost_model_s(runs):
    for case in runs[0]["parity"]:
        assert case["all_to_all_calls"] == case["predicted_calls"] == 10   # 2 layers x (4 + 1)
        assert case["bytes_ratio"] == pytest.approx(1.0, abs=1e-9)
    # one rank alone differs (it returns what its experts received): the sum is what is fixed
    per_rank = [r["parity"][0]["all_to_all_bytes"] for r in runs]
    assert len(set(per_rank)) > 1


@pytest.mark.multirank
def test_the_auxiliary_loss_keeps_the_experts_balanced(runs):
    without, with_aux = runs[0]["balance"]
    assert without["aux_coef"] == 0 and with_aux["aux_coef"] > 0
    assert without["imbalance_first"] == with_aux["imbalance_first"]    # the same start
    for a, b in zip(without["imbalance_last"], with_aux["imbalance_last"]):
        assert b < a                                    # aux loss: less imbalance
    assert max(without["imbalance_last"]) > max(without["imbalance_first"])   # it drifts
    assert all(sum(c) == 4 * 4 * 32 * 2 for c in without["tokens_per_expert_last"])


@pytest.mark.multirank
def test_dropped_assignments_follow_the_capacity(runs):
    rows = runs[0]["capacity"]
    for r in rows:
        assert r["dropped"] == r["predicted"], r          # from the router's own counts
        assert r["capacity"] == int(-(-r["capacity_factor"] * 512 * 2 // 8)), r
    share = {(r["capacity_factor"], r["layer"]): r["share"] for r in rows}
    for layer in (0, 1):
        shares = [share[cf, layer] for cf in (0.5, 1.0, 1.25, 2.0)]
        assert shares == sorted(shares, reverse=True) and shares[0] >= 0.5   # > balanced


@pytest.mark.multirank
def test_time_is_split_and_shown_with_its_spread(runs):
    t = runs[0]["time"]
    for part in ("step", "all_to_all", "moe_compute"):
        assert 0 < t[part]["min"] <= t[part]["median"] <= t[part]["max"]
    assert t["all_to_all"]["median"] < t["step"]["median"]


def test_moe_from_block_copies_mixtral_s_weights():
    torch = pytest.importorskip("torch")
    model = lab.build_model()
    block = model.model.layers[0].mlp
    moe = lab.moe_from_block(block)
    x = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(block(x), moe(x), atol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        lab.main(["--steps", "0"])


@pytest.mark.multirank
def test_a_world_that_does_not_split_the_experts_is_refused():
    with pytest.raises(LabError, match="8 experts"):
        run_lab("labkit.labs.moe", nproc=3, timeout=120, quiet=True, args=["--part", "capacity"])
