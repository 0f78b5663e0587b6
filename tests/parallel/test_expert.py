"""labkit.parallel.expert: the router, the one-process MoE against a token-by-token loop, GShard's
capacity and its priority, the rank-major to expert-major permutation; and on 2 and 4 gloo ranks
(tests/fixtures/labs/moe_parity.py, one launch each) expert parallelism against the one-process
MoE: outputs, every gradient, dropped assignments and the auxiliary loss, for k = 1 and 2, with
dropped tokens, shared experts, sigmoid scores and experts no token chooses."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from labkit.parallel import expert
from labkit.parallel.expert import MoE, TopKRouter, capacity, kept_mask, permute_to_expert_major

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
TOL = 1e-12                                        # float64 rounding (seen: <= 7e-15)


def test_router_picks_the_top_k_and_normalises():
    torch.manual_seed(0)
    r = TopKRouter(6, 5, 2).double()
    x = torch.randn(7, 6, dtype=torch.float64)
    out = r(x)
    probs = (x @ r.gate.weight.t()).softmax(-1)
    top = probs.topk(2, -1)
    assert torch.equal(out.indices, top.indices)
    assert torch.allclose(out.weights, top.values / top.values.sum(-1, keepdim=True))
    assert out.tokens_per_expert.sum() == 7 * 2
    assert torch.equal(out.tokens_per_expert, torch.bincount(top.indices.flatten(), minlength=5))
    raw = TopKRouter(6, 5, 2, normalize=False).double()
    raw.load_state_dict(r.state_dict())
    assert torch.allclose(raw(x).weights, top.values)
    sig = TopKRouter(6, 5, 2, score="sigmoid").double()
    sig.load_state_dict(r.state_dict())
    s = sig(x)
    assert torch.allclose(s.weights.sum(-1), torch.ones(7, dtype=torch.float64))
    assert torch.equal(s.indices, (x @ r.gate.weight.t()).sigmoid().topk(2, -1).indices)


def test_the_auxiliary_loss_is_one_when_balanced_and_e_when_collapsed():
    r = TopKRouter(4, 4, 1).double()
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4, dtype=torch.float64) * 30)
    balanced = r(torch.eye(4, dtype=torch.float64))          # each token its own expert
    assert balanced.aux_loss.item() == pytest.approx(1.0, rel=1e-6)
    collapsed = r(torch.tensor([[1.0, 0, 0, 0]] * 8, dtype=torch.float64))
    assert collapsed.aux_loss.item() == pytest.approx(4.0, rel=1e-6)


def loop_moe(moe, x):
    """Token by token, choice by choice: what the MoE computes, written the slow way."""
    r = moe.router(x)
    cap = capacity(x.shape[0], moe.k, moe.num_experts, moe.capacity_factor)
    taken = [0] * moe.num_experts
    y = torch.zeros_like(x)
    for j in range(moe.k):                        # GShard: first choices first, then seconds
        for t in range(x.shape[0]):
            e = int(r.indices[t, j])
            if cap is not None and taken[e] >= cap:
                continue
            taken[e] += 1
            h = F.silu(x[t] @ moe.w_gate[e]) * (x[t] @ moe.w_up[e])
            y[t] += r.weights[t, j] * (h @ moe.w_down[e])
    if moe.shared is not None:
        g, u, d = moe.shared
        y = y + (F.silu(x @ g) * (x @ u)) @ d
    return y


@pytest.mark.parametrize("kw", [dict(k=1), dict(k=2), dict(k=2, capacity_factor=0.5),
                                dict(k=3, capacity_factor=1.0, shared_experts=2),
                                dict(k=2, score="sigmoid")])
def test_moe_is_the_token_by_token_sum(kw):
    torch.manual_seed(3)
    moe = MoE(6, 10, 5, **kw).double()
    x = torch.randn(9, 6, dtype=torch.float64)
    y = moe(x)
    assert (y - loop_moe(moe, x)).abs().max() < TOL
    assigned = moe.last.tokens_per_expert.sum().item()
    assert assigned == 9 * kw["k"]
    if "capacity_factor" in kw:
        cap = moe.last.capacity
        assert cap == -(-int(kw["capacity_factor"] * 9 * kw["k"] * 1000) // (5 * 1000))
        kept = assigned - moe.last.dropped
        assert kept == sum(min(int(n), cap) for n in moe.last.tokens_per_expert)
    else:
        assert moe.last.dropped == 0 and moe.last.capacity is None
    assert moe(x.view(3, 3, 6)).shape == (3, 3, 6)


def test_capacity_keeps_first_choices_before_second_choices():
    # expert 0 is tokens 0-2's second choice and token 3's first; capacity 1: token 3 keeps
    # it (first choices first), and token 3's second choice, expert 2, is token 1's first
    idx = torch.tensor([[1, 0], [2, 0], [1, 0], [0, 2]])
    keep = kept_mask(idx, 3, cap=1)
    assert keep.tolist() == [[True, False], [True, False], [False, False], [True, False]]
    assert kept_mask(idx, 3, cap=2).tolist() == [[True, True], [True, False], [True, False],
                                                 [True, True]]
    assert capacity(4, 2, 3, 0.5) == 2 and capacity(4, 2, 3, None) is None


def test_permute_to_expert_major_reorders_rank_major_tokens():
    # 2 ranks sent tokens for this rank's 3 experts: counts rank-major (e0,r0) (e1,r0) (e2,r0)
    # (e0,r1) (e1,r1) (e2,r1); received rows are numbered 0..8 in that order
    counts = torch.tensor([2, 0, 1, 1, 3, 2])
    idx, per_expert = permute_to_expert_major(counts, 2)
    assert idx.tolist() == [0, 1, 3, 4, 5, 6, 2, 7, 8]
    assert per_expert.tolist() == [3, 3, 3]
    empty, none = permute_to_expert_major(torch.zeros(4, dtype=torch.long), 2)
    assert empty.numel() == 0 and none.tolist() == [0, 0]
    one, same = permute_to_expert_major(torch.tensor([2, 1]), 1)      # one rank: unchanged
    assert one.tolist() == [0, 1, 2] and same.tolist() == [2, 1]


@pytest.mark.parametrize("call, words", [
    (lambda: permute_to_expert_major(torch.tensor([1, 2, 3]), 2), "not a multiple of ep_size=2"),
    (lambda: permute_to_expert_major(torch.tensor([1.0, 2.0]), 1), "whole counts"),
    (lambda: permute_to_expert_major(torch.tensor([1, -1]), 1), "negative"),
    (lambda: permute_to_expert_major(torch.tensor([1, 1]), 0), "ep_size"),
    (lambda: TopKRouter(4, 3, 4), "k=4"),
    (lambda: TopKRouter(4, 3, 1, score="relu"), "score"),
    (lambda: MoE(4, 8, 4, 2, capacity_factor=0), "capacity_factor"),
    (lambda: MoE(4, 8, 4, 2, shared_experts=-1), "shared_experts"),
])
def test_bad_input_is_a_message(call, words):
    with pytest.raises(ValueError, match=words):
        call()


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request):
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "moe_parity.py", nproc=request.param, timeout=180, quiet=True).results


def test_expert_parallelism_equals_one_process(ranks):
    for rank, out in enumerate(ranks):
        for name, c in out.items():
            if name in ("world_size", "ep2_edp2"):
                continue
            assert max(c["diff"].values()) < TOL, (rank, name, c["diff"])
            assert c["dropped"][0] == c["dropped"][1], (rank, name)
            assert c["aux"][0] == pytest.approx(c["aux"][1], rel=1e-12), (rank, name)
    cases = ranks[0]
    assert cases["k2_dropped"]["dropped"][1] > 0 and cases["k1_dropped_shared"]["dropped"][1] > 0
    assert cases["k2_empty_experts"]["empty_experts"] >= 2       # some experts got no token
    assert "replicated_1" in cases["k1_dropped_shared"]["diff"]  # shared experts compared



def test_ep_folds_into_the_data_parallel_ranks(ranks):
    """On 4 ranks, EP = 2 x EDP = 2: the expert mesh's groups are Degrees.groups', and EP over
    each group of 2 equals the MoE on that group's tokens (with dropped assignments)."""
    if len(ranks) != 4:
        pytest.skip("the 4-rank launch checks the folded mesh")
    for out in ranks:
        c = out["ep2_edp2"]
        assert c["groups"] == c["want"] and c["local"] == 4
        assert c["diff"] < TOL and c["dropped"] > 0


def test_expert_groups_fold_as_megatron_lays_them_out():
    from labkit.parallel.mesh import Degrees

    d = Degrees.for_world(8, tp=2, ep=4)                 # dp 4; experts: ep 4 x edp 2
    assert d.edp == 2 and d.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    d = Degrees.for_world(16, tp=2, pp=2, ep=2, etp=2)   # per stage: edp 2 x ep 2 x etp 2
    assert d.groups("etp") == d.groups("tp")
    assert d.groups("ep")[:2] == [[0, 2], [1, 3]] and d.groups("edp")[0] == [0, 4]
    for axis in ("ep", "edp", "etp"):                    # every rank once per view
        assert sorted(r for g in d.groups(axis) for r in g) == list(range(16))
    assert "ep2 x etp2 x edp2" in str(d)
    with pytest.raises(ValueError, match="ep=3 x etp=1 does not divide"):
        Degrees.for_world(8, tp=2, ep=3)
    with pytest.raises(ValueError, match="two views"):
        d.groups("ep", "tp")


@pytest.mark.parametrize("world, kw", [(8, dict(tp=2, ep=4)), (16, dict(tp=2, pp=2, ep=2, etp=2))])
def test_both_views_of_the_same_ranks_are_drawn(world, kw):
    """The dense and the expert view partition the same ranks; mesh_figure draws each."""
    from labkit.parallel.mesh import Degrees
    from labkit.plots import png_bytes
    from labkit.plots.mesh import mesh_figure

    d = Degrees.for_world(world, **kw)
    for expert in (False, True):
        view = d.view(expert=expert)
        for groups in view.values():
            assert sorted(r for g in groups for r in g) == list(range(world))
        fig = mesh_figure(view, gpus_per_node=8, title=str(d))
        titles = [ax.get_title() for ax in fig.axes]
        assert any(t.startswith("ep:") for t in titles) == expert
        assert png_bytes(fig, dpi=30).startswith(b"\x89PNG")
