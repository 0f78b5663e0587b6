"""The compile lab (labkit.labs.compile): torch.compile with DDP and FSDP2 on 2 gloo ranks.

Each part runs once (module fixtures), with aot_eager (no C++ compiler needed; dynamo's graphs,
breaks and recompiles are the same for every backend). The ddp run asks for inductor with a C++
compiler that does not exist, so it also shows the fallback. The counts asserted are what torch
2.13 does with transformers 5's Llama: a torch upgrade that changes one fails here, naming it.
"""
from __future__ import annotations

import uuid

import pytest

from labkit.labs.compile import parse_args
from labkit.runtime.launch import run_lab
from proctools import MARK, wait_until_gone

pytestmark = pytest.mark.multirank
MARKER = f"compile-{uuid.uuid4().hex[:8]}"
SMALL = ["--steps", "3"]
NO_CXX = "labkit-no-such-cxx"


def lab(*args: str):
    return run_lab("labkit.labs.compile", nproc=2, timeout=240, quiet=True,
                   env={MARK: MARKER}, args=[*args, *SMALL])


@pytest.fixture(scope="module")
def ddp():
    return lab("--part", "ddp", "--cxx", NO_CXX)


@pytest.fixture(scope="module")
def fsdp():
    return lab("--part", "fsdp", "--backend", "aot_eager", "--layers", "2")


@pytest.fixture(scope="module")
def order():
    return lab("--part", "order")


def test_without_a_cxx_compiler_inductor_falls_back_to_aot_eager_with_a_note(ddp):
    for r in ddp.results:
        assert (r["backend_wanted"], r["backend"]) == ("inductor", "aot_eager")
        assert NO_CXX in r["note"] and "install" in r["note"]
    text = "\n".join(ddp.output)
    assert "note: inductor needs a C++ compiler" in text and "Traceback" not in text


def test_ddp_compiled_matches_eager_and_splits_one_graph_per_bucket(ddp):
    for r in ddp.results:
        assert r["parity_ok"] and r["loss_max_diff"] <= 1e-5, r["loss_max_diff"]
        c, eager = r["runs"]["compiled"], r["runs"]["eager"]
        assert (c["graphs"], c["recompiles"]) == (1, 0), "dynamo traced more than one graph"
        # DDPOptimizer hands the backend one subgraph per bucket, buckets as DDP sizes them
        assert c["backend_graphs"] == len(eager["ddp_buckets"]) == 2
        assert sorted(g["param_bytes"] for g in c["subgraphs"]) == sorted(eager["ddp_buckets"])
        # DDP rebuilds its buckets in the order gradients arrive: compiled, they arrive otherwise
        assert sum(c["ddp_buckets"]) == sum(eager["ddp_buckets"]) == r["param_bytes"]
        assert len(c["ddp_buckets"]) == 3, f"torch changed: compiled buckets {c['ddp_buckets']}"
        # the breaks are DDP's own forward (outside the module): 3 on torch 2.13
        assert c["breaks"] == 3 and any("_inside_ddp_forward" in k for k in c["break_reasons"])
        assert c["first_s"] > c["step_s"] > 0


def test_fsdp2_per_block_compile_traces_one_graph_for_every_block(fsdp):
    for r in fsdp.results:
        assert r["parity_ok"] and r["loss_max_diff"] <= 1e-5, r["loss_max_diff"]
        c = r["runs"]["compiled"]
        assert r["blocks"] == 2
        # no break, and (no KV cache in training) the blocks share one graph: no recompile
        assert (c["graphs"], c["backend_graphs"], c["breaks"], c["recompiles"]) == (1, 1, 0, 0), \
            f"torch or transformers changed: {c['graphs']} graphs, {c['recompiles']} recompiles"


def test_a_kv_cache_left_on_recompiles_each_block_until_the_limit_then_runs_eagerly(order):
    for r in order.results:
        on, off = r["cases"]["kv_cache_on"], r["cases"]["kv_cache_off"]
        assert r["deep_blocks"] == r["recompile_limit"] + 2
        assert on["error"] is None and off["error"] is None
        # transformers' cache update guards on each block's cache state: block 1 recompiles,
        # and past the limit dynamo gives up on the rest (they run eagerly, silently)
        assert on["recompiles"] >= 1 and on["refused"] >= 1, (on["recompiles"], on["refused"])
        assert any("cache" in k for k in on["recompile_reasons"]), on["recompile_reasons"]
        assert "recompile limit" in on["refused_reasons"][0]
        assert (off["graphs"], off["recompiles"], off["refused"]) == (1, 0, 0)
        assert on["losses"] == pytest.approx(off["losses"], abs=1e-5)


def test_fully_shard_then_whole_model_compile_works_with_breaks_at_fsdp_hooks(order):
    for r in order.results:
        c = r["cases"]["fsdp_whole"]
        assert c["error"] is None, f"torch changed: it now fails: {c['error']}"
        assert r["fsdp_whole_parity"]["parity_ok"]
        # FSDP2's hooks are dynamo-disabled: a break at each, the model cut into 5 graphs
        assert (c["breaks"], c["graphs"]) == (5, 5), f"torch changed: {c['breaks']} breaks, " \
                                                     f"{c['graphs']} graphs"
        assert list(c["break_reasons"]) == ["Attempted to call function marked as skipped: "
                                            "disable"], c["break_reasons"]
        assert c["recompiles"] == 2 and c["refused"] > 0


def test_compile_before_ddp_also_splits_per_bucket_without_breaks(order):
    for r in order.results:
        c = r["cases"]["ddp_compile_first"]
        assert c["error"] is None and r["ddp_compile_first_parity"]["parity_ok"]
        assert c["backend_graphs"] == len(r["cases"]["ddp_eager"]["ddp_buckets"]) == 2
        assert c["breaks"] == 0 and c["graphs"] == 1


def test_a_bucket_below_ddp_s_first_bucket_is_refused_and_reported(order):
    for r in order.results:
        c = r["cases"]["small_bucket"]
        assert c["error"] == "AssertionError" and "First bucket" in c["error_line"]
        assert c["losses"] == [] and c["backend_graphs"] == 0


def test_new_shapes_recompile_once_then_dynamic_or_hit_the_limit(order):
    for r in order.results:
        auto, static = r["cases"]["dynamic_auto"], r["cases"]["dynamic_false"]
        assert len(r["seqs"]) == 4 and r["recompile_limit"] == 2
        assert auto["new_graphs"] == [1, 1, 0, 0] and auto["recompiles"] == 1
        assert auto["refused"] == 0          # the second graph is dynamic: no more compiles
        assert static["new_graphs"] == [1, 1, 0, 0] and static["recompiles"] == 1
        assert static["refused"] == 1        # the limit: steps 3 and 4 run eagerly
        assert "recompile limit" in static["refused_reasons"][0]


def test_nothing_is_left_running(ddp, fsdp, order):
    waited, left = wait_until_gone(MARKER, 20)
    assert not left, f"processes still running {waited:.1f} s after the runs: {left}"


@pytest.mark.parametrize("argv, message", [
    (["--part", "jit"], "invalid choice: 'jit'"),
    (["--backend", "tensorrt"], "invalid choice: 'tensorrt'"),
    (["--steps", "2"], "allowed: >= 3"),
    (["--bucket-mb", "0.5"], "is not a bucket size in MiB from 1 to 1024"),
    (["--heads", "5"], "does not divide --hidden"),
])
def test_bad_flags_say_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
