"""labkit.parallel.context: ring attention by hand. In this process: the ring simulated for cp
ranks (no messages) against SDPA's full attention, forward and backward, GQA, both layouts; the
layouts' positions and causal load balance; bad inputs. On 2 and 4 gloo ranks
(tests/fixtures/labs/cp_ring.py, one launch each): the real ring over send/recv, over the world and over
the cp=2 groups of a DeviceMesh, outputs and q/k/v gradients against one process, and the messages counted against
labkit.comm.step_communication("cp")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from labkit.comm import step_communication
from labkit.models import get_model
from labkit.parallel import context

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"
B, HEADS, KV_HEADS, S, D = 2, 4, 2, 16, 8         # tests/fixtures/labs/cp_ring.py's sizes
TOL = 1e-12                                       # float64 rounding (seen: <= 3e-15)


def qkvw(seed=0, heads=HEADS, kv_heads=KV_HEADS, s=S):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(B, h, s, D, generator=g, dtype=torch.float64)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), make(heads)


def grads(fn, q, k, v, w):
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ins)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in ins]


@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_simulated_ring_equals_full_attention(layout, causal, cp):
    q, k, v, w = qkvw()
    ref, ref_g = grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal,
                                                                 enable_gqa=True), q, k, v, w)
    out, g = grads(lambda *t: context.simulated_ring_attention(*t, cp, causal=causal,
                                                               layout=layout), q, k, v, w)
    assert (out - ref).abs().max() < TOL
    for a, b in zip(g, ref_g):
        assert (a - b).abs().max() < TOL


def test_one_process_ring_is_full_attention():
    q, k, v, _ = qkvw(1, heads=2, kv_heads=2)
    out = context.ring_attention(q, k, v, causal=True)
    assert (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max() < TOL


@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_layouts_partition_the_sequence(layout, cp):
    held = [context.positions(r, cp, 32, layout) for r in range(cp)]
    assert all(len(h) == 32 // cp for h in held)
    assert sorted(p for h in held for p in h) == list(range(32))
    x = torch.arange(32).view(1, 1, 32, 1)
    for r in range(cp):
        assert context.shard_sequence(x, r, cp, layout).flatten().tolist() == held[r]


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    s, cp = 64, 4
    total = s * (s + 1) // 2                      # visible (query, key) pairs of causal attention
    for layout in context.LAYOUTS:
        assert sum(context.causal_work(cp, s, layout)) == total
    zig = context.causal_work(cp, s, "zigzag")
    assert len(set(zig)) == 1
    contiguous = context.causal_work(cp, s, "contiguous")
    assert contiguous == sorted(contiguous) and contiguous[-1] > zig[0] > contiguous[0]
    assert contiguous[-1] / contiguous[0] > cp          # the last rank: several times the first


@pytest.mark.parametrize("call, words", [
    (lambda: context.positions(0, 3, 16), ["seq_len=16", "3 equal chunks", "multiples of 3"]),
    (lambda: context.positions(0, 4, 12, "zigzag"), ["8 equal chunks", "'zigzag'"]),
    (lambda: context.positions(4, 4, 16), ["rank=4", "0 to 3"]),
    (lambda: context.positions(0, 2, 16, "ring"), ["layout='ring'", "'zigzag'"]),
    (lambda: context.ring_attention(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4),
                                    torch.zeros(2, 3, 4)), ["q must be a 4-D", "[batch, heads"]),
    (lambda: context.ring_attention(*qkvw(heads=3)[:3]), ["k's heads must divide"]),
    (lambda: context.simulated_ring_attention(*qkvw()[:3], 3), ["seq_len=16", "3 equal"]),
    (lambda: context.ring_attention(*qkvw()[:3], causal="yes"), ["causal='yes'"]),
])
def test_bad_inputs_are_refused_with_a_clear_message(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_torch_context_parallel_cpu_status_is_documented():
    assert "does not run on CPU in" in context.__doc__ and "torch 2.13" in context.__doc__


# ---------------------------------------------------------------------------------------------
# real ranks

@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "cp_ring.py", nproc=request.param, timeout=180, quiet=True).results


CASES = ["world_contiguous_causal", "world_contiguous_full", "world_zigzag_causal",
         "world_zigzag_full", "cp2_group"]


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES)
def test_ring_on_ranks_equals_one_process(ranks, case):
    for rank in ranks:
        diff = rank[case]["diff"]
        assert set(diff) == {"out", "q_grad", "k_grad", "v_grad"}
        assert max(diff.values()) < TOL, diff


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES)
def test_messages_match_step_communication(ranks, case):
    cp = 2 if case == "cp2_group" else ranks[0]["world_size"]
    spec = get_model("debug-llama").with_(num_layers=1, hidden_size=HEADS * D, num_heads=HEADS,
                                          num_kv_heads=KV_HEADS, max_seq_len=S)
    (msg,) = step_communication("cp", model=spec, cp=cp, batch_size=B, seq_len=S,
                                activation_bytes=8).collectives
    assert msg.count == 3 * (cp - 1)              # forward K,V; backward K,V again and dK,dV
    for rank in ranks:
        for phase in ("forward", "backward"):
            comm = rank[case]["comm"][phase]
            assert set(comm) == {"send", "recv"}
            sends, nbytes = comm["send"]
            assert sends == cp - 1                # this ring keeps K/V: no re-send backward
            assert nbytes == sends * msg.nbytes   # each message: K and V packed, as counted
