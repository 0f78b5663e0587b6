"""labkit.parallel.mesh: the degrees, the ranks in each group (pure Python, against Megatron-LM's
published example and the definition), nodes, bad degrees with clear messages. On 4 gloo ranks
(tests/fixtures/labs/mesh_2d.py, one launch): the DeviceMesh's groups equal Degrees.groups, and the
composition TP -> activation checkpointing -> FSDP2 of a transformers Llama on dp2 x tp2 trains
with the loss of one process."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from torch import nn

from labkit.parallel.mesh import AXES, Degrees, node_of, parallelize

LABS = Path(__file__).resolve().parents[1] / "fixtures" / "labs"


def test_megatron_example_tp2_pp4_on_16():
    # Megatron-LM's initialize_model_parallel docstring: 16 GPUs, tp 2, pp 4 (so dp 2)
    d = Degrees.for_world(16, tp=2, pp=4)
    assert d.dp == 2 and d.world == 16
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                              [14, 15]]
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                              [13, 15]]
    assert d.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_2x2_and_2x2x2():
    d = Degrees(dp=2, tp=2)
    assert (d.groups("tp"), d.groups("dp")) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert d.groups("pp") == d.groups("cp") == [[0], [1], [2], [3]]
    d = Degrees(pp=2, dp=2, tp=2)
    assert d.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.groups("dp", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_dp16_tp8_on_16_nodes_keeps_tp_inside_a_node():
    d = Degrees(dp=16, tp=8)
    assert d.nodes_spanned("tp", 8) == 1
    assert d.nodes_spanned("dp", 8) == 16
    for g in d.groups("tp"):
        assert g == list(range(g[0], g[0] + 8)) and node_of(g[0], 8) == g[0] // 8
    assert Degrees(dp=8, tp=16).nodes_spanned("tp", 8) == 2       # tp 16 cannot stay in 8


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 1, 2), (3, 2, 2, 2), (2, 1, 4, 1)])
def test_groups_follow_the_coordinates(shape):
    d = Degrees(**dict(zip(AXES, shape)))
    ranks = range(d.world)
    assert [tuple(d.coords(r).values()) for r in ranks] == list(itertools.product(
        *(range(n) for n in shape)))               # row-major over (pp, dp, cp, tp)
    for axes in [(a,) for a in AXES] + [("dp", "cp")]:
        groups = d.groups(*axes)
        assert sorted(r for g in groups for r in g) == list(ranks)
        for g in groups:
            size = 1
            for a in axes:
                size *= getattr(d, a)
            assert len(g) == size
            fixed = [{a: v for a, v in d.coords(r).items() if a not in axes} for r in g]
            assert all(f == fixed[0] for f in fixed)


@pytest.mark.parametrize("call, words", [
    (lambda: Degrees(tp=0), ["tp=0", ">= 1"]),
    (lambda: Degrees(dp=True), ["dp=True"]),
    (lambda: Degrees.for_world(8, tp=3), ["tp=3", "world=8", "allowed products: 1, 2, 4, 8"]),
    (lambda: Degrees.for_world(8, xp=2), ["degree='xp'", "'tp'", "'ep'"]),
    (lambda: Degrees(dp=4, ep=3), ["ep=3", "allowed ep"]),
    (lambda: Degrees(dp=2, tp=2).check(world=8), ["= 4 ranks", "world size is 8"]),
    (lambda: Degrees(tp=3).check("llama2-7b"), ["tp=3", "num_heads=32", "allowed: 1, 2, 4"]),
    (lambda: Degrees(tp=16).check("llama3-8b"), ["tp=16", "num_kv_heads=8", "1, 2, 4, 8"]),
    (lambda: Degrees(pp=5).check("llama2-7b"), ["pp=5", "num_layers=32", "allowed"]),
    (lambda: Degrees(pp=64).check("llama2-7b", uneven_stages=True), ["pp=64", "1 to 32"]),
    (lambda: Degrees(cp=3).check(seq_len=4096), ["cp=3", "seq_len=4096", "allowed cp: 1, 2"]),
    (lambda: Degrees(cp=4).check(seq_len=12, causal_balanced=True),
     ["cp=4", "8 equal chunks", "allowed cp: 1, 2, 3, 6"]),
    (lambda: Degrees(dp=3).check(global_batch=8), ["dp=3", "global_batch=8", "allowed dp: 1, 2"]),
    (lambda: Degrees(dp=4).check(global_batch=8, microbatch=4), ["microbatch=4", "dp: 1, 2"]),
    (lambda: Degrees().groups("xp"), ["axis='xp'", "'pp', 'dp', 'cp', 'tp'"]),
    (lambda: Degrees(dp=2).coords(2), ["rank=2", "0 to 1"]),
    (lambda: node_of(-1, 8), ["rank=-1"]),
])
def test_bad_degrees_name_the_degree_and_what_is_allowed(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_good_published_layouts_pass():
    Degrees(tp=8, pp=16, dp=128).check("llama3-405b", uneven_stages=True, seq_len=8192,
                                       global_batch=2048, world=16384)
    Degrees(tp=8, pp=8, dp=2, cp=2).check("llama2-70b", seq_len=4096, causal_balanced=True)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])


@pytest.mark.parametrize("kwargs, words", [
    (dict(mesh=object()), ["mesh has no dimension names", "mesh_dim_names"]),
    (dict(mesh=object(), tp_plan="gpt"), ["tp_plan='gpt'", "'llama'"]),
    (dict(mesh=object(), mp={"dtype": "bf16"}), ["mp=", "param_dtype"]),
    (dict(mesh=object(), fsdp=False, mp={"param_dtype": "bf16"}), ["needs fsdp=True"]),
])
def test_parallelize_refuses_bad_arguments(kwargs, words):
    mesh = kwargs.pop("mesh")
    with pytest.raises(ValueError) as err:
        parallelize(_Blocks(), mesh, **kwargs)
    for word in words:
        assert word in str(err.value)


# ---------------------------------------------------------------------------------------------
# real ranks

@pytest.fixture(scope="module")
def ranks():
    from labkit.runtime.launch import run_lab
    return run_lab(LABS / "mesh_2d.py", nproc=4, timeout=180, quiet=True).results


@pytest.mark.multirank
def test_device_mesh_groups_equal_degrees_groups(ranks):
    layouts = {"dp2_tp2": Degrees(dp=2, tp=2), "dp2_cp2": Degrees(dp=2, cp=2)}
    for name, d in layouts.items():
        for axes in [(a,) for a in AXES] + ([("dp", "cp")] if name == "dp2_cp2" else []):
            key = "_".join(axes)
            seen = {tuple(r["groups"][name][key]) for r in ranks}
            assert sorted(seen) == sorted(map(tuple, d.groups(*axes))), (name, key)
            for rank, r in enumerate(ranks):
                assert rank in r["groups"][name][key]


@pytest.mark.multirank
def test_tp_fsdp_composition_trains_like_one_process(ranks):
    for r in ranks:
        assert set(r["losses"]) == {"tp_fsdp", "tp_ac_fsdp"}
        for losses in r["losses"].values():
            assert len(losses) == len(r["reference"]) == 3
            assert max(abs(a - b) for a, b in zip(losses, r["reference"])) < 1e-5


@pytest.mark.multirank
def test_composition_order_tp_then_fsdp_then_checkpointing(ranks):
    for r in ranks:
        p = r["placements"]
        assert p["mesh"] == ["dp", "tp"]                  # FSDP sharded the TP'd DTensor (2D)
        assert p["full_shape"] == [32, 32] and p["local_shape"] == [8, 32]   # / tp / dp
        assert r["checkpointed"] == 2                     # every decoder layer recomputed
