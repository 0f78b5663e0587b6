"""Module 03's measured lab (labkit.labs.ddp), its timeline plot and `labkit bench ddp`.

Each part runs once on 2 gloo ranks (a module fixture shared by every assertion about it), on a
small GPT-2 (2 layers, h 64) so that the whole file stays well under 90 s on 2 busy cores.
Expected values are computed here, independently of the lab: GPT-2's tensor count, the
gradient bytes, torch's DistributedSampler rule. No assertion is on speed beyond a generous
bound that a sleep guarantees (the machine is shared).
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from labkit.runtime.launch import run_lab

N = 2
LAYERS, HIDDEN = 2, 64
SMALL = ["--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", "4", "--seq", "32",
         "--batch", "2"]
KINDS = ("naive", "overlapped", "bucketed", "torch")


def lab(*args) -> list[dict]:
    return run_lab("labkit.labs.ddp", nproc=N, timeout=240, quiet=True,
                   args=[*SMALL, *args]).results


def gpt2_params(layers=LAYERS, h=HIDDEN, vocab=1024, positions=64) -> tuple[int, int]:
    """(parameters, tensors) of transformers' GPT-2 with tied embeddings: per layer two
    LayerNorms (2 x 2h), c_attn (3h^2 + 3h), attn c_proj (h^2 + h), c_fc (4h^2 + 4h), mlp
    c_proj (4h^2 + h): 12 tensors; plus wte, wpe and the final LayerNorm (4 tensors)."""
    per_layer = 4 * h + 3 * h * h + 3 * h + h * h + h + 4 * h * h + 4 * h + 4 * h * h + h
    return vocab * h + positions * h + layers * per_layer + 2 * h, 12 * layers + 4


# ---------------------------------------------------------------------------------------------
# --part compare

@pytest.fixture(scope="module")
def compare():
    return lab("--part", "compare", "--steps", "5", "--bucket-mb", "0.1")


@pytest.mark.multirank
def test_compare_matches_the_one_process_reference(compare):
    """fp32 throughout: the 1-process mean over the whole batch and the ranks' average of
    their shard means differ only in summation order, a few float32 ulps (the loss, ~6.9, has
    an ulp of 4.8e-7; seen: 1 ulp on the loss, 6e-8 on the parameters). 1e-5 leaves 20x that
    and is far below what a wrong average does: an SGD step with lr 0.1 on a summed gradient
    (N x too large) moves the parameters by ~1e-4 to 1e-3."""
    r0 = compare[0]
    for k in KINDS:
        assert r0["loss_max_diff"][k] <= 1e-5, (k, r0["loss_max_diff"])
        assert r0["param_max_diff"][k] <= 1e-5, (k, r0["param_max_diff"])
        assert len(r0["losses"][k]) == len(r0["reference_losses"]) == 5
    for r in compare:      # every rank applied the same averaged gradient
        assert r["replica_max_diff"] == {k: 0.0 for k in KINDS}
        assert r["losses"] == r0["losses"]


@pytest.mark.multirank
def test_compare_bytes_equal_the_prediction_exactly(compare):
    params, tensors = gpt2_params()
    for r in compare:
        assert (r["num_params"], r["param_tensors"]) == (params, tensors)
        assert r["predicted"]["bytes"] == 4 * params
        # a ring all-reduce sends 2(N-1)/N of the buffer per rank
        assert r["predicted"]["wire_bytes"] == pytest.approx(2 * (N - 1) / N * 4 * params)
        for k in KINDS:
            assert r["allreduce"][k]["bytes"] == 4 * params, (k, r["allreduce"])
            assert r["ratio"]["bytes"][k] == 1.0
            assert r["other_collectives"][k] == {}   # after warm-up: nothing but the gradients
        assert r["allreduce"]["local"] == {"calls": 0, "bytes": 0}


@pytest.mark.multirank
def test_compare_calls_one_per_tensor_or_bucket(compare):
    from labkit.parallel.ddp import assign_buckets

    _, tensors = gpt2_params()
    r = compare[0]
    calls = {k: r["allreduce"][k]["calls"] for k in KINDS}
    assert calls["naive"] == calls["overlapped"] == tensors
    for k in KINDS:
        assert calls[k] == r["predicted"]["calls"][k]
    # the bucketed reference's plan over this GPT-2's tensor sizes, in registration order (the
    # order naive all-reduces them in)
    sizes = [nbytes for _, _, nbytes in r["timeline"]["naive"]["allreduce"]]
    assert calls["bucketed"] == len(assign_buckets(sizes, 0.1))
    assert 1 < calls["bucketed"] < tensors and 1 < calls["torch"] < tensors


@pytest.mark.multirank
def test_compare_timeline_shows_what_overlap_hides(compare):
    from labkit.plots.timeline import summarize

    _, tensors = gpt2_params()
    r = compare[0]
    for k in KINDS:
        ev = r["timeline"][k]
        s = summarize(ev)
        assert len(ev["grads"]) == tensors and len(ev["allreduce"]) == r["allreduce"][k]["calls"]
        assert sum(b for _, _, b in ev["allreduce"]) == r["predicted"]["bytes"]
        assert all(0 <= a <= b <= ev["sync_end"] for a, b, _ in ev["allreduce"])
        assert ev["forward_end"] <= s["compute_end"] <= ev["sync_end"] <= ev["step_end"]
        first_issue = min(a for a, _, _ in ev["allreduce"])
        if k == "naive":       # launched after backward: nothing hidden
            assert first_issue >= s["compute_end"] and s["comm_hidden"] == 0
        else:                  # the last layers' gradients leave while earlier ones compute
            assert first_issue < s["compute_end"] and s["comm_hidden"] > 0
    assert r["timeline_summary"]["local"]["allreduces"] == 0
    for k in ("local", *KINDS):
        assert r["step_s"][k] > 0 and r["predicted"]["step_s"][k] > 0
        assert r["samples_per_s"][k] == pytest.approx(2 * N / r["step_s"][k])


@pytest.mark.multirank
def test_bench_summary_reads_the_lab_report(compare):
    from labkit.cli.bench_ddp import summary

    r = compare[0]
    s = summary(r)
    assert s["bucketed_vs_torch"] == pytest.approx(r["step_s"]["torch"] / r["step_s"]["bucketed"])
    assert s["gain_bucketed"] == pytest.approx(r["step_s"]["naive"] / r["step_s"]["bucketed"])
    assert set(s["exposed"]) == set(KINDS)


def test_timeline_figure_and_summary():
    from labkit.plots.timeline import summarize, timeline_figure, union

    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    ev = {"forward_end": 1.0, "grads": [["b", 2.0], ["a", 3.0]],
          "allreduce": [[2.0, 3.5, 8], [3.0, 4.0, 8], [5.0, 6.0, 4]], "sync_end": 6.0,
          "step_end": 6.5}
    s = summarize(ev)
    # busy [2, 4] and [5, 6]; before the last gradient (t=3): [2, 3]
    assert (s["compute_end"], s["comm_busy"], s["comm_hidden"], s["exposed"]) == (3.0, 3.0, 1.0, 3.0)
    assert s["overlap"] == pytest.approx(1 / 3) and s["allreduces"] == 3
    fig = timeline_figure({"bucketed": ev, "naive": {**ev, "allreduce": []}})
    ax, = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["bucketed: all-reduce",
                                                                 "bucketed: compute"]
    with pytest.raises(ValueError, match="events\\['x'\\] must be a dict with keys"):
        timeline_figure({"x": {"grads": []}})
    with pytest.raises(ValueError, match="timelines must be a non-empty dict"):
        timeline_figure({})


# ---------------------------------------------------------------------------------------------
# --part flags

@pytest.fixture(scope="module")
def flags():
    return lab("--part", "flags", "--steps", "1", "--caps", "0.05,0.25,25", "--micro", "3",
               "--bucket-mb", "0.1", "--buffer-elements", "100")


@pytest.mark.multirank
def test_flags_bucket_cap(flags):
    params, _ = gpt2_params()
    r = flags[0]
    rows = r["bucket_cap_mb"]
    assert [x["value"] for x in rows] == [0.05, 0.25, 25.0]
    calls = [x["calls"] for x in rows]
    assert calls[0] > calls[1] > calls[2] == 1          # smaller buckets, more all-reduces
    for x in rows:
        assert x["calls"] == x["predicted_calls"] == len(x["bucket_sizes"])
        assert x["bytes"] == 4 * params and x["ratio_bytes"] == 1.0
        assert sum(x["bucket_sizes"]) == 4 * params
        # torch closes a bucket at the parameter that fills it: every bucket but the last
        # holds >= cap bytes (one large tensor makes a larger one), so at most G / cap + 1
        cap = x["value"] * 2**20
        assert all(b >= cap for b in x["bucket_sizes"][:-1]), x["bucket_sizes"]
        assert x["calls"] <= 4 * params / cap + 1
        assert x["model_buckets"] == math.ceil(4 * params / cap)    # labkit.scaling's estimate


@pytest.mark.multirank
def test_flags_gradient_as_bucket_view_saves_a_gradient_copy(flags):
    G = 4 * gpt2_params()[0]
    off, on = flags[0]["gradient_as_bucket_view"]
    assert (off["value"], on["value"]) == (False, True)
    assert off["memory"] == 2 * G and on["memory"] == G        # storage accounting, exact
    assert off["memory_ratio"] == on["memory_ratio"] == 1.0
    assert off["bytes"] == on["bytes"] == G                     # the wire does not change


@pytest.mark.multirank
def test_flags_find_unused_parameters(flags):
    G, T = 4 * gpt2_params()[0], gpt2_params()[1]
    r = flags[0]
    off, on, unused = r["find_unused_parameters"]
    assert off["bytes"] == G and off["calls"] == off["predicted_calls"]
    # the flag adds one all-reduce: the int32 map of which parameter tensors were used
    assert on["calls"] == off["calls"] + 1 and on["bytes"] == G + 4 * T
    u = 8 * 8 + 8
    assert unused["unused_params"] == u
    assert unused["bytes"] == G + 4 * u + 4 * (T + 2) == unused["predicted_bytes"]
    assert r["unused_error"].startswith("Expected to have finished reduction in the prior "
                                        "iteration before starting a new one")


@pytest.mark.multirank
def test_flags_static_graph_and_broadcast_buffers(flags):
    G = 4 * gpt2_params()[0]
    r = flags[0]
    assert [x["bytes"] for x in r["static_graph"]] == [G, G]
    gpt2, on, off = r["broadcast_buffers"]
    assert (gpt2["buffer_bytes"], gpt2["broadcasts"]) == (0, 0)   # GPT-2 has no buffers
    assert (on["broadcasts"], on["broadcast_bytes"]) == (1, 400)  # one coalesced per forward
    assert (off["broadcasts"], off["broadcast_bytes"]) == (0, 0)
    for x in r["broadcast_buffers"]:
        assert x["broadcasts"] == x["predicted_broadcasts"]
        assert x["broadcast_bytes"] == x["predicted_broadcast_bytes"]


@pytest.mark.multirank
def test_flags_no_sync_divides_the_all_reduces_by_k(flags):
    G, k = 4 * gpt2_params()[0], 3
    rows = flags[0]["no_sync"]
    assert [(x["impl"], x["value"]) for x in rows] == [("torch", False), ("torch", True),
                                                      ("bucketed", False), ("bucketed", True)]
    for plain, quiet in (rows[:2], rows[2:]):
        assert plain["calls"] == k * quiet["calls"] and quiet["calls"] >= 1
        assert (plain["bytes"], quiet["bytes"]) == (k * G, G)
        assert plain["ratio_bytes"] == quiet["ratio_bytes"] == 1.0
        assert plain["calls"] == plain["predicted_calls"] and quiet["calls"] == quiet["predicted_calls"]
        # the same accumulated, averaged gradient either way
        assert quiet["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# --part straggler and --part sampler

@pytest.mark.multirank
def test_straggler_slows_every_rank():
    from labkit.scaling import throughput_loss

    sleep = 0.25
    res = lab("--part", "straggler", "--sleep", str(sleep), "--steps", "3")
    r = res[0]
    assert r["slow_rank"] == 1 and len(r["slow_s"]) == len(r["base_s"]) == N
    for base, slow in zip(r["base_s"], r["slow_s"]):
        # rank 0 cannot finish before rank 1's gradients, sent after its sleep (its own step
        # is ~10 ms; 0.5 leaves room for the ranks leaving the barrier apart on a busy machine)
        assert slow >= 0.5 * sleep and slow > base
    t_base, t_slow = statistics.median(r["base_s"]), statistics.median(r["slow_s"])
    assert r["throughput_loss"] == pytest.approx(1 - t_base / t_slow)
    assert r["throughput_loss"] == pytest.approx(throughput_loss(t_slow / t_base - 1))
    assert r["throughput_loss"] < r["step_time_increase"]       # 1 - 1/(1+x) < x
    assert res[1]["slow_s"] == r["slow_s"]                      # every rank sees every rank


def sampler_indices(n, replicas, rank, shuffle, drop_last, seed, epoch):
    """DistributedSampler's documented rule: permute (randperm seeded with seed + epoch) or
    not; pad to a multiple of the replicas by repeating from the start, or cut with
    drop_last; rank r takes every replicas-th index from r."""
    order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
             if shuffle else list(range(n)))
    total = (n // replicas if drop_last else -(-n // replicas)) * replicas
    order = (order * 2)[:total]
    return order[rank::replicas]


@pytest.mark.multirank
def test_sampler_indices_on_real_ranks():
    n = 11
    res = lab("--part", "sampler", "--samples", str(n), "--seed", "3")
    assert len(res[0]["sampler"]) == 8
    for rank, r in enumerate(res):
        for row in r["sampler"]:
            want = sampler_indices(n, N, rank, row["shuffle"], row["drop_last"], 3, row["epoch"])
            assert row["indices"] == want, (rank, row)
            assert row["match"]
    rows = res[0]["all_ranks"]
    for i, row in enumerate(res[0]["sampler"]):
        seen = [x for ranks in rows for x in ranks[i]["indices"]]
        if row["drop_last"]:           # 11 = 2 x 5 + 1: one sample left out, none repeated
            assert len(seen) == 10 == len(set(seen))
        else:                          # padded to 12: one sample twice
            assert len(seen) == 12 and len(set(seen)) == 11
    by = {(x["shuffle"], x["drop_last"], x["epoch"]): x["indices"] for x in res[0]["sampler"]}
    assert by[(True, False, 0)] != by[(True, False, 1)]    # set_epoch reshuffles
    assert by[(False, False, 0)] == by[(False, False, 1)]  # without shuffle it changes nothing


# ---------------------------------------------------------------------------------------------
# bad input

@pytest.mark.parametrize("argv,message", [
    (["--part", "compare", "--steps", "4"], "argument --steps: 4 is too few for --part compare"),
    (["--caps", "1,-2"], "argument --caps: '1,-2' is not a list of bucket sizes"),
    (["--bucket-mb", "1,2"], "argument --bucket-mb: give one size"),
    (["--sleep", "-1"], "argument --sleep: '-1' is not a number of seconds from 0 to 3600"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a learning rate"),
    (["--link", "carrier-pigeon"], "argument --link: invalid choice: 'carrier-pigeon'"),
    (["--batch", "0"], "argument --batch: '0' is not a whole number >= 1"),
    (["--heads", "3"], "argument --heads: 3 does not divide --hidden 128"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    from labkit.labs.ddp import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_bench_refuses_too_few_steps(capsys):
    from labkit.cli.bench_ddp import main

    with pytest.raises(SystemExit):
        main(["--steps", "3"])
    assert "argument --steps: 3 is too few" in capsys.readouterr().err


@pytest.mark.multirank
def test_straggler_sleep_in_steps_scales_with_the_machine():
    """--sleep-steps 2: rank 1 sleeps twice the warm-up's healthy step, whatever that step is
    on this machine, so every rank's slow step holds at least ~2 healthy steps."""
    r = lab("--part", "straggler", "--sleep-steps", "2", "--steps", "3")[0]
    assert r["sleep_steps"] == 2
    base = statistics.median(r["base_s"])
    # the warm-up's median (the slowest rank's) is no shorter than a timed step's minimum
    # unless the machine got much busier between them; 0.5 allows for that
    assert r["sleep"] > 0.5 * 2 * base, (r["sleep"], base)
    for b, slow in zip(r["base_s"], r["slow_s"]):
        assert slow > b and slow >= 0.5 * r["sleep"]
    assert r["step_time_increase"] > 0.5


# ---------------------------------------------------------------------------------------------
# gradient_as_bucket_view's copies; torch's bucket rule (the quiz's ddp-bucket-count)

@pytest.mark.multirank
def test_flags_gradient_as_bucket_view_still_copies_in_under_set_to_none(flags):
    """torch 2.13's DDP docstring (batched_grad_copy): under zero_grad(set_to_none=True), the
    default, "gradient_as_bucket_view alone cannot avoid copies because the bucket view alias is
    destroyed every iteration". Counted by storage over the T gradient tensors: the flag saves
    the copy out, and the copy in only when zero_grad keeps the views."""
    G, T = 4 * gpt2_params()[0], gpt2_params()[1]
    off, on = flags[0]["gradient_as_bucket_view"]
    kept = flags[0]["bucket_view_zeroed_in_place"]
    assert (off["set_to_none"], on["set_to_none"], kept["set_to_none"]) == (True, True, False)
    assert off["copies"] == {"in": T, "out": T} == off["predicted_copies"]
    assert on["copies"] == {"in": T, "out": 0} == on["predicted_copies"]
    assert kept["copies"] == {"in": 0, "out": 0} == kept["predicted_copies"]
    assert kept["memory"] == on["memory"] == G and kept["bytes"] == G


@pytest.mark.multirank
def test_torch_rule_buckets_counts_what_torch_ddp_made(flags):
    """labkit.quiz.answers_ddp.torch_rule_buckets (torch's assignment over meta tensors of the
    lab's GPT-2, last layer first) gives the bucket count torch's reducer reports."""
    from labkit.models import get_model
    from labkit.quiz.answers_ddp import torch_rule_buckets

    spec = get_model("debug-gpt2").with_(
        num_layers=LAYERS, hidden_size=HIDDEN, num_heads=4, num_kv_heads=4,
        ffn_size=4 * HIDDEN, vocab_size=1024, max_seq_len=64)
    rows = flags[0]["bucket_cap_mb"]
    assert [len(x["bucket_sizes"]) for x in rows] == [torch_rule_buckets(spec, x["value"])
                                                      for x in rows] == [7, 2, 1]
