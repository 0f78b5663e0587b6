"""labkit.planner.decision: the decision framework by model size and cluster (which lever to turn
on first, and what each later one buys), reproduced by the planner's own ranking.

Rungs, cheapest lever first: data parallel, + sharding (ZeRO/FSDP), + recompute, + TP inside a
node, + PP across nodes, + CP. The framework says: 1B on 8 GPUs, plain DP; 7B on 8, shard the
states (16 B/param x 7B does not fit in 80 GB); 70B on 64, shard and recompute to fit, then TP 8
inside the node pays; 405B on 16k, TP 8 first (2,048 sequences cannot spread over 16,384
data-parallel ranks), then more; 405B at 128k tokens, PP is needed to fit and CP pays tenfold;
405B on 8 GPUs, nothing.
"""
from __future__ import annotations

import pytest

from labkit.planner import LADDER, Layout, decide, decision, plan, rung_of

H100 = dict(gpu="h100-sxm")


def levers(d):
    return (d.first.lever if d.first else None), [r.lever for r in d.worth]


def check_consistent(d):
    """Each rung's best is the fastest ranked layout of its levers; the last is the plan's."""
    times = [r.best.step_time for r in d.rungs if r.best]
    assert times == sorted(times, reverse=True)
    for k, r in enumerate(d.rungs):
        if r.best is not None:
            assert rung_of(r.best.layout) <= k and r.reason == ""
            faster = [e for e in d.plan.ranked   # at the ranking precision, 4 digits
                      if float(f"{e.step_time:.4g}") < float(f"{r.best.step_time:.4g}")]
            assert all(rung_of(e.layout) > k for e in faster)
        else:
            assert r.reason.startswith(("nothing fits", "nothing runs"))
    assert d.rungs[-1].best is d.plan.best


def test_rung_of_a_layout_is_its_last_lever():
    assert [lever for lever, _, _ in LADDER][0] == "data parallel"
    assert rung_of(Layout(dp=8)) == 0
    assert rung_of(Layout(dp=8, sharding="zero1")) == 1
    assert rung_of(Layout(dp=8, sharding="fsdp", recompute="full")) == 2
    assert rung_of(Layout(tp=8, dp=8)) == 3 and rung_of(Layout(pp=2)) == 4
    assert rung_of(Layout(cp=2, tp=8)) == 5


def test_1b_on_8_gpus_is_plain_data_parallelism():
    d = decision("llama3.2-1b", 8, global_batch=256, seq_len=4096, **H100)
    check_consistent(d)
    assert levers(d) == ("data parallel", [])
    lay = d.plan.best.layout
    assert (lay.tp, lay.pp, lay.cp, lay.dp) == (1, 1, 1, 8)
    assert "<- turn on first" in d.text().splitlines()[0]


def test_7b_on_8_gpus_shards_the_states_first():
    d = decision("llama2-7b", 8, **H100)
    check_consistent(d)
    assert levers(d) == ("sharding (ZeRO / FSDP)", [])
    assert "memory: needs" in d.rungs[0].reason            # replicated states do not fit
    lay = d.plan.best.layout
    assert lay.sharding != "ddp" and (lay.tp, lay.pp, lay.cp) == (1, 1, 1)


def test_70b_on_64_gpus_shards_recomputes_then_tp_inside_the_node():
    d = decision("llama2-70b", 64, global_batch=512, seq_len=4096, **H100)
    check_consistent(d)
    first, worth = levers(d)
    assert first == "recompute" and worth[0] == "TP inside a node"
    assert d.rungs[0].best is None and d.rungs[1].best is None
    assert d.rungs[3].best.layout.tp in (4, 8)              # TP inside the node
    assert d.plan.best.layout.pp > 1                        # and layers split across nodes


def test_405b_on_16k_gpus_starts_with_tp_8():
    d = decision("llama3-405b", 16384, global_batch=2048, seq_len=8192, **H100)
    check_consistent(d)
    assert levers(d)[0] == "TP inside a node"
    assert "not divisible by dp=16,384" in d.rungs[0].reason
    assert d.rungs[3].best.layout.tp == 8 and 4 <= d.plan.best.layout.tp <= 8


def test_405b_at_128k_tokens_needs_pp_and_cp_pays():
    d = decision("llama3-405b", 16384, global_batch=128, seq_len=131072, **H100)
    check_consistent(d)
    assert levers(d) == ("PP across nodes", ["CP"])
    pp, cp = d.rungs[4].best, d.rungs[5].best
    assert cp.layout.cp > 1 and cp.step_time < pp.step_time / 10


def test_405b_on_8_gpus_has_no_rung():
    d = decide(plan("llama3-405b", 8, global_batch=64, **H100))
    check_consistent(d)
    assert levers(d) == (None, [])
    assert all("nothing fits" in r.reason for r in d.rungs)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="gpus=0 must be a whole number >= 1"):
        decision("llama2-7b", 0)
