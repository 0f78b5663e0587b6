"""Module 10's exercises: the references the check cells compare with (each against a closed form
written here), the check cells themselves run on the usual wrong answers (each fails, saying
what is wrong), the dispatch runner (labkit.labs.dispatch), where a learner's dispatch and
combine reaches 4 gloo ranks and every usual mistake comes back as a sentence with its numbers,
and the graded notebook."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from labkit.course import exercises as ex
from labkit.course import grading, reference
from labkit.labs import dispatch
from labkit.labs.dispatch import EXPERTS, HIDDEN, run_user_dispatch

SOLUTION = ex.REPO_ROOT / "solutions" / "10_mixture_of_experts.ipynb"


# ------------------------------------------------------------------------------ references

def _inputs(tokens, hidden, experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=g, dtype=torch.float64),
            torch.randn(experts, hidden, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("tokens, hidden, experts, k", [(16, 8, 4, 1), (16, 8, 4, 2),
                                                        (64, 16, 8, 2), (40, 12, 6, 3)])
def test_top_k_route_reference_is_the_switch_gshard_router(tokens, hidden, experts, k):
    x, w = _inputs(tokens, hidden, experts)
    got = reference.top_k_route(x, w, k)
    probs = torch.softmax(x @ w.T, dim=-1)
    top, idx = probs.topk(k, dim=-1)
    counts = torch.zeros(experts, dtype=torch.long)
    for e in idx.flatten().tolist():
        counts[e] += 1
    f = counts.double() / (tokens * k)
    aux = experts * sum(float(f[e]) * float(probs[:, e].mean()) for e in range(experts))
    assert torch.allclose(got["probs"], probs, rtol=1e-12, atol=0)
    assert torch.equal(got["indices"], idx)
    assert torch.allclose(got["weights"], top / top.sum(-1, keepdim=True), rtol=1e-12, atol=0)
    assert torch.allclose(got["weights"].sum(-1), torch.ones(tokens, dtype=torch.float64))
    assert torch.equal(got["tokens_per_expert"], counts) and int(counts.sum()) == tokens * k
    assert got["aux_loss"] == pytest.approx(aux, rel=1e-12)


def test_the_auxiliary_loss_is_one_when_balanced_and_e_when_one_expert_takes_all():
    x = _inputs(32, 8, 4)[0].abs() + 0.1
    assert reference.top_k_route(x, torch.zeros(4, 8, dtype=torch.float64), 1)["aux_loss"] == \
        pytest.approx(1.0)                          # uniform probabilities
    gate = torch.zeros(4, 8, dtype=torch.float64)
    gate[0] = 100.0                                 # expert 0 takes every token, surely
    assert reference.top_k_route(x, gate, 1)["aux_loss"] == pytest.approx(4.0, rel=1e-6)


def test_routing_shapes_says_what_a_result_holds():
    x, w = _inputs(5, 4, 3)
    assert reference.routing_shapes(reference.top_k_route)(x, w, 2) == {
        "probs": (5, 3), "indices": (5, 2), "weights": (5, 2), "tokens_per_expert": (3,),
        "aux_loss": "a number"}
    assert reference.routing_shapes(lambda *a: (1, 2))(x, w, 2).startswith("a tuple, not a dict")
    assert reference.routing_shapes(lambda *a: {"aux_loss": torch.tensor(1.0), "p": [1]})(
        x, w, 2) == {"aux_loss": "a number", "p": "a list"}


@pytest.mark.parametrize("counts, ep, indices, per_expert", [
    ([1, 2, 2, 1], 2, [0, 3, 4, 1, 2, 5], [3, 3]),          # the notebook's example
    ([2, 0, 1, 3, 0, 2, 1, 1], 4, [0, 1, 2, 8, 3, 4, 5, 6, 7, 9], [4, 6]),
    ([3, 0, 2], 3, [0, 1, 2, 3, 4], [5]),                    # one expert per rank: as it came
    ([0, 0, 0, 0], 2, [], [0, 0]),
])
def test_permute_reference_by_hand(counts, ep, indices, per_expert):
    got = reference.as_lists(reference.permute_to_expert_major)(torch.tensor(counts), ep)
    assert got == (indices, per_expert)


def test_permute_reference_groups_each_expert_in_source_rank_order():
    g = torch.Generator().manual_seed(0)
    for ep, local in [(2, 4), (4, 2), (8, 3), (1, 5)]:
        counts = torch.randint(0, 4, (ep * local,), generator=g)
        # each received row tagged (local expert, source rank, its place in that rank's rows)
        rows = [(e, r, i) for r in range(ep) for e in range(local)
                for i in range(int(counts[r * local + e]))]
        idx, per_expert = reference.permute_to_expert_major(counts, ep)
        assert [rows[i] for i in idx.tolist()] == sorted(rows)
        assert per_expert.tolist() == counts.view(ep, local).sum(0).tolist()


@pytest.mark.parametrize("tokens, k, hidden, nbytes, cf", [
    (4096, 2, 4096, 2, None), (4096, 2, 4096, 2, 1.25), (2048, 8, 7168, 2, 1.0),
    (1024, 8, 2048, 1, 1.5), (3, 1, 10, 4, 1.25)])
def test_all_to_all_bytes_is_four_buffers_of_routed_tokens(tokens, k, hidden, nbytes, cf):
    want = 4 * tokens * k * (cf or 1) * hidden * nbytes
    assert reference.all_to_all_bytes(tokens, k, hidden, nbytes, cf) == pytest.approx(want,
                                                                                     rel=1e-12)


def test_mixtral_step_is_every_layer_at_the_share_that_leaves_the_rank():
    layer = 4 * 4096 * 2 * 1.25 * 4096 * 2
    assert reference.ep_step_gb("mixtral-8x7b", ep=8, seq_len=4096, capacity_factor=1.25) == \
        pytest.approx(32 * layer * 7 / 8 / 1e9, rel=1e-12)


# ------------------------------------------------------------ the check cells, wrong answers

def _check_cell(exercise: str) -> str:
    nb = ex.read_notebook(SOLUTION)
    lay = ex.layout(nb)
    (check,) = [c for c in lay.checks if c.exercise == exercise]
    return nb.cells[check.index].source


def _run_check(exercise: str, **answers) -> str:
    """The solutions notebook's check cell of `exercise`, run here with `answers` as the
    learner's names: the GradingError's message (the check must fail)."""
    ns = {"torch": torch, "grading": grading, "reference": reference, **answers}
    with pytest.raises(grading.GradingError) as err:
        exec(_check_cell(exercise), ns)       # noqa: S102 - the course's own check cell
    return str(err.value)


def _route(x, gate_weight, k, *, renormalise=True, ascending=False, aux_scale=1.0,
           first_choice_only=False, as_tuple=False):
    probs = (x @ gate_weight.T).softmax(dim=-1)
    top, idx = probs.topk(k, dim=-1)
    if ascending:
        idx, order = idx.sort(dim=-1)
        top = top.gather(1, order)
    weights = top / top.sum(-1, keepdim=True) if renormalise else top
    chosen = idx[:, :1] if first_choice_only else idx
    counts = torch.bincount(chosen.flatten(), minlength=gate_weight.shape[0])
    share = torch.bincount(idx.flatten(), minlength=gate_weight.shape[0]) / idx.numel()
    aux = aux_scale * gate_weight.shape[0] * (share * probs.mean(0)).sum()
    out = {"probs": probs, "indices": idx, "weights": weights, "tokens_per_expert": counts,
           "aux_loss": aux}
    return tuple(out.values()) if as_tuple else out


def top_k_route(x, gate_weight, k):
    return _route(x, gate_weight, k)


def test_the_router_check_passes_the_right_answer(capsys):
    exec(_check_cell("router"), {"torch": torch, "grading": grading, "top_k_route": top_k_route})
    out = capsys.readouterr().out
    assert out.count("\u2713") == 21 and "case 4 (T=40, E=6, k=3): aux_loss" in out


@pytest.mark.parametrize("options, words", [
    ({"renormalise": False}, ["case 1 (T=16, E=4, k=1): weights: tensor values differ",
                              "expected 1, received 0.", "add up to one"]),
    ({"ascending": True}, ["case 2 (T=16, E=4, k=2): indices: tensor values differ",
                           "the most probable first"]),
    ({"aux_scale": 2.0}, ["case 1 (T=16, E=4, k=1): aux_loss: wrong value",
                          "received is 2x expected"]),
    ({"first_choice_only": True}, ["case 2 (T=16, E=4, k=2): tokens_per_expert: tensor "
                                   "values differ", "every choice of every token"]),
    ({"as_tuple": True}, ["the five parts and their shapes: wrong result for top_k_route(",
                          "received: 'a tuple, not a dict of probs, indices, weights, "
                          "tokens_per_expert, aux_loss'"]),
])
def test_the_router_check_names_the_part_that_is_wrong(options, words):
    def top_k_route(x, gate_weight, k):
        return _route(x, gate_weight, k, **options)

    text = _run_check("router", top_k_route=top_k_route)
    for w in words:
        assert w in text, text


def test_the_router_check_on_a_stub_says_not_attempted():
    def top_k_route(x, gate_weight, k):
        raise NotImplementedError("Exercise router: write ~9 lines")

    assert grading.NOT_ATTEMPTED in _run_check("router", top_k_route=top_k_route)


def _permute_right(counts, ep):
    counts = torch.as_tensor(counts)
    local = counts.numel() // ep
    owner = torch.arange(local).repeat(ep).repeat_interleave(counts)
    return torch.argsort(owner, stable=True), counts.view(ep, local).sum(0)


@pytest.mark.parametrize("wrong, words", [
    (lambda c, ep: (torch.arange(int(torch.as_tensor(c).sum())), _permute_right(c, ep)[1]),
     "received: ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 6])"),
    (lambda c, ep: (_permute_right(c, ep)[0], torch.as_tensor(c).view(ep, -1)[0]),
     "received: ([0, 1, 2, 8, 3, 4, 5, 6, 7, 9], [2, 0])"),
    (lambda c, ep: _permute_right(c, ep)[0], "received: [0, 1, 2, 8, 3, 4, 5, 6, 7, 9]"),
])
def test_the_permute_check_fails_wrong_permutations(wrong, words):
    grading.check_callable("p", reference.as_lists(_permute_right),
                           [(torch.tensor([2, 0, 1, 3, 0, 2, 1, 1]), 4)],
                           reference=reference.as_lists(reference.permute_to_expert_major))
    wrong.__name__ = "permute_to_expert_major"
    text = _run_check("permute", permute_to_expert_major=wrong)
    assert "wrong result for permute_to_expert_major(tensor([2, 0, 1, 3, 0, 2, 1, 1]), 4)" in text
    assert "expected: ([0, 1, 2, 8, 3, 4, 5, 6, 7, 9], [4, 6])" in text and words in text, text


def _a2a(tokens, k, hidden, nbytes, capacity_factor=None):
    return 4 * tokens * k * (capacity_factor or 1) * hidden * nbytes


@pytest.mark.parametrize("wrong, words", [
    (lambda t, k, h, b, capacity_factor=None: _a2a(t, k, h, b, capacity_factor) / 2,
     "that is a known mistake: half of the exchanges"),
    (lambda t, k, h, b, capacity_factor=None: _a2a(t, k, h, b, capacity_factor) / 4,
     "that is a known mistake: one all-to-all only"),
    (lambda t, k, h, b, capacity_factor=None: _a2a(t, k, h, b),
     "that is a known mistake: the capacity factor left out"),
    (lambda t, k, h, b, capacity_factor=None: _a2a(t, 1, h, b, capacity_factor),
     "that is a known mistake: k left out"),
    (lambda t, k, h, b, capacity_factor=None: 8 * _a2a(t, k, h, b, capacity_factor),
     "bits vs bytes?"),
])
def test_the_all_to_all_bytes_check_names_the_usual_mistakes(wrong, words):
    wrong.__name__ = "all_to_all_bytes"
    text = _run_check("a2a_bytes", all_to_all_bytes=wrong, mixtral_step_gb=0.0)
    assert "all_to_all_bytes: wrong result for all_to_all_bytes(" in text and words in text, text


@pytest.mark.parametrize("gb, words", [(32 * _a2a(4096, 2, 4096, 2, 1.25) / 1e9,
                                        "ratio received/expected: 1.143"),   # all of it, not 7/8
                                       (_a2a(4096, 2, 4096, 2, 1.25) * 7 / 8 / 1e9,
                                        "received is 1/32 of expected")])     # one layer
def test_the_mixtral_check_fails_what_does_not_leave_the_rank(gb, words):
    text = _run_check("a2a_bytes", all_to_all_bytes=_a2a, mixtral_step_gb=gb)
    assert text.startswith("mixtral_step_gb: wrong value") and words in text, text


# ------------------------------------------------ the dispatch runner, without ranks (fast)

def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nproc=3: allowed 2, 4 or 8"):
        run_user_dispatch(dispatch_combine, nproc=3)
    with pytest.raises(ValueError, match="run_user_dispatch takes a function fn\\(x, expert, "
                                         "num_experts, expert_fn\\) .* received 'f' \\(a str\\)"):
        run_user_dispatch("f")


def stub(x, expert, num_experts, expert_fn):
    raise NotImplementedError("Exercise dispatch: write ~20 lines")


def test_a_stub_fails_at_once_without_ranks():
    with pytest.raises(NotImplementedError, match="stub is not written yet"):
        run_user_dispatch(stub)


def test_expert_fn_holds_only_this_ranks_experts_and_counts_tokens():
    seen = torch.zeros(EXPERTS, dtype=torch.long)
    fn = dispatch.expert_fn_of(1, 4, seen)            # rank 1 of 4: experts 2 and 3
    w, b = dispatch.weights()
    t = torch.ones(3, HIDDEN)
    assert torch.equal(fn(3, t), t @ w[3] + b[3]) and torch.equal(fn(torch.tensor(2), t[:1]),
                                                                  t[:1] @ w[2] + b[2])
    assert seen.tolist() == [0, 0, 1, 3, 0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"expert_fn\(5, \.\.\.\) was called on rank 1, which "
                                         r"holds experts 2 to 3: expert 5 lives on rank 2"):
        fn(5, t)
    with pytest.raises(ValueError, match=r"tokens must be rows of shape \(n, 32\); received "
                                         r"\(32,\)"):
        fn(2, t[0])
    held = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)
            and c.cell_contents.dim() == 3]
    assert [t.shape[0] for t in held] == [2]         # its two experts' weights, no other


def test_the_cases_are_whole_numbers_and_the_skewed_one_leaves_ranks_without_tokens():
    for world in (2, 4, 8):
        got = torch.zeros(EXPERTS, dtype=torch.long)
        for rank in range(world):
            x, e = dispatch.tokens("skewed", rank, world)
            assert torch.equal(x, x.round()) and x.shape == (5 + rank, HIDDEN)
            got += torch.bincount(e, minlength=EXPERTS)
        local = EXPERTS // world
        if world > 2:
            assert got[2 * local:].sum() == 0           # ranks 2.. receive nothing
        assert (got == 0).any()                          # an expert nobody chose


# ----------------------------------------------------------------------- learners' answers
# (module level, so that the runner finds their source in this file)

def dispatch_combine(x, expert, num_experts, expert_fn):
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = num_experts // ep
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    send = counts.view(ep, local).sum(1).tolist()
    recv = received.view(ep, local).sum(1).tolist()
    inbox = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(inbox, x[order].contiguous(), recv, send)
    owner = (torch.arange(local).repeat(ep) + rank * local).repeat_interleave(received)
    done = torch.empty_like(inbox)
    for e in range(rank * local, (rank + 1) * local):
        if (owner == e).any():
            done[owner == e] = expert_fn(e, inbox[owner == e])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _to(x, expert, dest, expert_fn):
    """Each token to the rank `dest` names, its expert's id along (a second all-to-all)."""
    ep = dist.get_world_size()
    order = torch.argsort(dest, stable=True)
    send_n = torch.bincount(dest, minlength=ep)
    recv_n = torch.empty_like(send_n)
    dist.all_to_all_single(recv_n, send_n)
    send, recv = send_n.tolist(), recv_n.tolist()
    inbox = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(inbox, x[order].contiguous(), recv, send)
    ids = torch.empty(sum(recv), dtype=torch.long)
    dist.all_to_all_single(ids, expert[order].contiguous(), recv, send)
    done = torch.empty_like(inbox)
    for e in ids.unique().tolist():
        done[ids == e] = expert_fn(e, inbox[ids == e])
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    return back[torch.argsort(order)]


def ids_along(x, expert, num_experts, expert_fn):
    """Another right answer: the expert ids travel with the tokens."""
    return _to(x, expert, expert // (num_experts // dist.get_world_size()), expert_fn)


def in_expert_order(x, expert, num_experts, expert_fn):
    """The combine's result as it came back: sorted by expert, not in x's order."""
    y = dispatch_combine(x, expert, num_experts, expert_fn)
    return y[torch.argsort(expert, stable=True)]


def round_robin(x, expert, num_experts, expert_fn):
    """Experts dealt to the ranks round-robin (e % ep), not in blocks."""
    return _to(x, expert, expert % dist.get_world_size(), expert_fn)


def gathered(x, expert, num_experts, expert_fn):
    """Every rank gathers every token, runs its experts on theirs, and the results are summed
    over the ranks: right outputs, but each token travels to every rank."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = num_experts // ep
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ep)]
    dist.all_gather(sizes, torch.tensor([len(x)]))
    n = max(int(s) for s in sizes)
    pad = x.new_zeros(n, x.shape[1])
    pad[:len(x)] = x
    ids = torch.full((n,), -1, dtype=torch.long)
    ids[:len(x)] = expert
    xs, es = [torch.empty_like(pad) for _ in range(ep)], [torch.empty_like(ids) for _ in range(ep)]
    dist.all_gather(xs, pad)
    dist.all_gather(es, ids)
    results = x.new_zeros(ep, n, x.shape[1])
    for r in range(ep):
        for e in range(rank * local, (rank + 1) * local):
            if (es[r] == e).any():
                results[r][es[r] == e] = expert_fn(e, xs[r][es[r] == e])
    dist.all_reduce(results)
    return results[rank, :len(x)]


def to_every_rank(x, expert, num_experts, expert_fn):
    """Every token sent to every rank by all-to-all, each rank keeping those of its experts."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = num_experts // ep
    n = torch.tensor([len(x)])
    sizes = torch.empty(ep, dtype=torch.long)
    dist.all_to_all_single(sizes, n.repeat(ep))
    inbox = x.new_empty(int(sizes.sum()), x.shape[1])
    dist.all_to_all_single(inbox, x.repeat(ep, 1), sizes.tolist(), [len(x)] * ep)
    ids = torch.empty(int(sizes.sum()), dtype=torch.long)
    dist.all_to_all_single(ids, expert.repeat(ep), sizes.tolist(), [len(x)] * ep)
    done = torch.zeros_like(inbox)
    for e in range(rank * local, (rank + 1) * local):
        if (ids == e).any():
            done[ids == e] = expert_fn(e, inbox[ids == e])
    back = x.new_empty(ep * len(x), x.shape[1])
    dist.all_to_all_single(back, done, [len(x)] * ep, sizes.tolist())
    return back.view(ep, len(x), -1).sum(0)


def every_local_expert(x, expert, num_experts, expert_fn):
    """Each local expert applied to every received token, the right rows picked after."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = num_experts // ep
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    send = counts.view(ep, local).sum(1).tolist()
    recv = received.view(ep, local).sum(1).tolist()
    inbox = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(inbox, x[order].contiguous(), recv, send)
    owner = (torch.arange(local).repeat(ep) + rank * local).repeat_interleave(received)
    done = torch.empty_like(inbox)
    for e in range(rank * local, (rank + 1) * local):
        if len(inbox):
            done[owner == e] = expert_fn(e, inbox)[owner == e]
    back = torch.empty_like(x)
    dist.all_to_all_single(back, done, send, recv)
    out = torch.empty_like(back)
    out[order] = back
    return out


def raises_on_rank_3(x, expert, num_experts, expert_fn):
    """Rank 3 fails after the counts: the others, left waiting in the token exchange, fail
    too; rank 3's own error is the one reported."""
    if dist.get_rank() == 3:
        counts = torch.bincount(expert, minlength=num_experts)
        dist.all_to_all_single(torch.empty_like(counts), counts)
        raise KeyError("rank 3's own mistake")
    return dispatch_combine(x, expert, num_experts, expert_fn)


# ---------------------------------------------------------------------------- on real ranks

_RUNS: dict = {}


def _run(fn, nproc=4):
    key = (fn, nproc)
    return _RUNS.get(key) or _RUNS.setdefault(key, run_user_dispatch(fn, nproc=nproc))


@pytest.mark.multirank
@pytest.mark.parametrize("fn, nproc", [(dispatch_combine, 4), (ids_along, 4),
                                       (dispatch_combine, 2)])
def test_right_answers_pass_with_the_tokens_moved_once_each_way(fn, nproc):
    r = _run(fn, nproc)
    assert r.ok, r.summary()
    rows = HIDDEN * 4
    for case in dispatch.CASES:
        per = r.cases[case]
        assert sum(p["received"] for p in per) == sum(p["tokens"] for p in per)
        for p in per:
            assert (p["tokens"] + p["received"]) * rows <= p["a2a"][1] <= \
                (p["tokens"] + p["received"]) * rows * 1.5 + p["counts_room"]
    if nproc == 4:
        assert [p["received"] for p in r.cases["skewed"]][2:] == [0, 0]
    assert "all correct" in r.summary()


@pytest.mark.multirank
@pytest.mark.parametrize("fn, aspect, words", [
    (in_expert_order, "output", "case 'random', rank 0: the right outputs, in the wrong order "
                                "(6 of 6 rows misplaced"),
    (round_robin, "runs", "your round_robin raised ValueError: expert_fn(4, ...) was called on "
                          "rank 0, which holds experts 0 to 1: expert 4 lives on rank 2; its "
                          "tokens must be sent there (in _to: "),
    (gathered, "collectives", "case 'random', rank 0: all_gather x 3 (6,560 B), all_reduce x 1 "
                              "(6,144 B) moved more than counts"),
    (to_every_rank, "collectives", "case 'random', rank 0: the all-to-alls carried 7,904 B, "
                                   "3.86 x the 2,048 B of this rank's tokens out"),
    (every_local_expert, "experts", "case 'random': expert 0 was applied to 10 tokens over all "
                                    "the ranks; 5 are routed to it"),
    (raises_on_rank_3, "runs", "your raises_on_rank_3 raised KeyError: \"rank 3's own mistake\" "
                               "(in raises_on_rank_3: raise KeyError("),
])
def test_mistakes_are_named_with_their_numbers(fn, aspect, words):
    r = _run(fn)
    assert not r.ok
    assert words in r.verdicts()[aspect], r.summary()
    assert f"PROBLEM: {r.verdicts()[aspect]}" in r.summary()


# ---------------------------------------------------------------------- the notebook, graded

@pytest.mark.notebook
@pytest.mark.multirank
@pytest.mark.slow
def test_wrong_answers_fail_the_graded_notebook_each_with_its_reason(tmp_path):
    """Through `labkit grade`: weights left unnormalised, outputs in expert order, the
    rank-major order kept, the forward's all-to-alls only: each check fails, saying so."""
    import nbformat

    from labkit.course import grader

    path = tmp_path / "exercises" / SOLUTION.name
    path.parent.mkdir()
    path.write_text(ex.render_path(SOLUTION), encoding="utf-8")
    nb = ex.read_notebook(path)
    lay = ex.layout(nb)
    answers = {
        "router": "import torch\n\n\ndef top_k_route(x, gate_weight, k):\n"
                  "    probs = (x @ gate_weight.T).softmax(-1)\n"
                  "    top, idx = probs.topk(k, dim=-1)\n"
                  "    counts = torch.bincount(idx.flatten(), minlength=len(gate_weight))\n"
                  "    aux = len(gate_weight) * (counts / idx.numel() * probs.mean(0)).sum()\n"
                  "    return {'probs': probs, 'indices': idx, 'weights': top,\n"
                  "            'tokens_per_expert': counts, 'aux_loss': aux}\n",
        "dispatch": "import torch\nimport torch.distributed as dist\n\n\n"
                    "def dispatch_combine(x, expert, num_experts, expert_fn):\n"
                    "    ep, rank = dist.get_world_size(), dist.get_rank()\n"
                    "    local = num_experts // ep\n"
                    "    order = torch.argsort(expert, stable=True)\n"
                    "    counts = torch.bincount(expert, minlength=num_experts)\n"
                    "    received = torch.empty_like(counts)\n"
                    "    dist.all_to_all_single(received, counts)\n"
                    "    send = counts.view(ep, local).sum(1).tolist()\n"
                    "    recv = received.view(ep, local).sum(1).tolist()\n"
                    "    inbox = x.new_empty(sum(recv), x.shape[1])\n"
                    "    dist.all_to_all_single(inbox, x[order].contiguous(), recv, send)\n"
                    "    owner = (torch.arange(local).repeat(ep) + rank * local)"
                    ".repeat_interleave(received)\n"
                    "    done = torch.empty_like(inbox)\n"
                    "    for e in owner.unique().tolist():\n"
                    "        done[owner == e] = expert_fn(e, inbox[owner == e])\n"
                    "    back = torch.empty_like(x)\n"
                    "    dist.all_to_all_single(back, done, send, recv)\n"
                    "    return back\n",
        "permute": "import torch\n\n\ndef permute_to_expert_major(tokens_per_expert_group, "
                   "ep_size):\n    counts = torch.as_tensor(tokens_per_expert_group)\n"
                   "    return torch.arange(int(counts.sum())), counts.view(ep_size, -1).sum(0)\n",
        "a2a_bytes": "def all_to_all_bytes(tokens, k, hidden, bytes_per_value, "
                     "capacity_factor=None):\n"
                     "    return 2 * tokens * k * (capacity_factor or 1) * hidden * "
                     "bytes_per_value\n\n\nmixtral_step_gb = 1.0\n",
    }
    for name, source in answers.items():
        nb.cells[lay.exercise(name).index].source = source
    nbformat.write(nb, str(path))
    report = grader.grade_notebook(path, template=SOLUTION, timeout=120)
    messages = {c.exercise: c.message for c in report.checks if not c.passed}
    assert set(messages) == set(answers), report.format()
    assert "case 1 (T=16, E=4, k=1): weights: tensor values differ" in messages["router"]
    assert "the right outputs, in the wrong order" in messages["dispatch"]
    assert "received: ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 6])" in messages["permute"]
    assert "that is a known mistake: half of the exchanges" in messages["a2a_bytes"]
    assert all(math.isfinite(c.seconds) for c in report.checks)
