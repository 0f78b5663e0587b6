"""Module 04's measured lab (labkit.labs.zero), its pictures (labkit.plots.zero) and
`labkit bench zero`.

The lab runs once on 2 gloo ranks (a module fixture shared by every assertion about it), on a
small Llama (2 layers, h 64), so the file stays well under 90 s on 2 busy cores. Expected values
are computed here, independently of the lab and of labkit.memory: the Llama's parameter count
from its shapes, the bytes each stage keeps (fp32 AdamW: 4 + 4 + 8 per parameter, the sharded
ones / N), the payload each stage's collectives carry. No assertion is on speed.
"""
from __future__ import annotations

import pytest

from labkit.runtime.launch import run_lab

N = 2
LAYERS, HIDDEN, VOCAB = 2, 64, 1024
SMALL = ["--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", "4", "--seq", "32",
         "--batch", "2", "--steps", "4"]
IMPLS = ("ddp", "zero1", "zero2", "zero3", "torch_zero")


def llama(layers=LAYERS, h=HIDDEN, vocab=VOCAB) -> tuple[int, int]:
    """(parameters, tensors) of the lab's Llama: untied embedding and head (V x h each), final
    RMSNorm (h); per layer q and o (h x h), k and v (h x h/2: half the heads for key/value),
    gate, up, down (h x 2h each) and two RMSNorms: 9 tensors."""
    per_layer = 2 * h * h + 2 * h * (h // 2) + 3 * h * 2 * h + 2 * h
    return 2 * vocab * h + h + layers * per_layer, 3 + 9 * layers


@pytest.fixture(scope="module")
def compare():
    return run_lab("labkit.labs.zero", nproc=N, timeout=240, quiet=True, args=SMALL).results


@pytest.mark.multirank
def test_each_rank_holds_what_its_stage_predicts_exactly(compare):
    P, _ = llama()
    expected = {"ddp": (4 * P, 4 * P, 8 * P), "zero1": (4 * P, 4 * P, 8 * P // N),
                "zero2": (4 * P, 4 * P // N, 8 * P // N),
                "zero3": (4 * P // N, 4 * P // N, 8 * P // N)}
    for r in compare:
        assert r["num_params"] == P
        for k, (p, g, o) in expected.items():
            s = r["stages"][k]
            assert s["measured"] == {"params": p, "grads": g, "optimizer_states": o}, k
            assert s["ratio"] == s["summed_ratio"] == {t: 1.0 for t in s["ratio"]}, k
        # torch's ZeroRedundancyOptimizer gives whole tensors to ranks: unequal shares, but the
        # ranks' optimizer states add up to exactly 8P
        zro = r["stages"]["torch_zero"]
        assert sum(rank[2] for rank in zro["by_rank"]) == 8 * P
        assert zro["summed_ratio"]["optimizer_states"] == 1.0
        # one flat shard per rank: one AdamW step counter (4 B), not one per tensor
        steps = {k: r["stages"][k]["optimizer_steps"] for k in ("zero1", "zero2")}
        assert steps == {"zero1": 4, "zero2": 4}
        assert r["stages"]["ddp"]["optimizer_steps"] == 4 * llama()[1]


@pytest.mark.multirank
def test_collective_bytes_equal_step_communication(compare):
    """ZeRO-1/2 carry DDP's 2 x 4P (reduce-scatter + all-gather = one all-reduce), ZeRO-3 gathers
    the weights twice: 1.5x; torch's ZeRO-1 adds a broadcast of the weights to DDP's all-reduce."""
    P, tensors = llama()
    payload = {"ddp": {"all_reduce": 4 * P},
               "zero1": {"reduce_scatter": 4 * P, "all_gather": 4 * P},
               "zero2": {"reduce_scatter": 4 * P, "all_gather": 4 * P},
               "zero3": {"all_gather": 8 * P, "reduce_scatter": 4 * P},
               "torch_zero": {"all_reduce": 4 * P, "broadcast": 4 * P}}
    for r in compare:
        for k, ops in payload.items():
            s = r["stages"][k]
            assert {op: c["bytes"] for op, c in s["collectives"].items()} == ops, k
            assert s["predicted_collectives"] == ops, k
            assert s["ratio_payload"] == 1.0 and set(s["ratio_collectives"].values()) == {1.0}
        # a ring sends 2(N-1)/N x 4P for DDP and for ZeRO-1/2, 3(N-1)/N x 4P for ZeRO-3
        ring = {k: r["stages"][k]["wire"]["predicted_ring"] for k in IMPLS}
        assert ring["ddp"] == ring["zero1"] == ring["zero2"]
        assert ring["ddp"] == pytest.approx(2 * (N - 1) / N * 4 * P)
        assert ring["zero3"] == pytest.approx(1.5 * ring["ddp"])
        calls = {op: c["calls"] for op, c in r["stages"]["zero3"]["collectives"].items()}
        assert calls == {"all_gather": 2 * tensors, "reduce_scatter": tensors}  # per tensor


@pytest.mark.multirank
def test_gloo_sends_its_reduce_scatter_as_an_all_reduce(compare):
    """What the processes wrote to their sockets: DDP's all-reduce is the ring's 2(N-1)/N x 4P,
    but ZeRO-1/2 send 1.5x that on gloo, not the same (its reduce-scatter is an all-reduce).
    Headers add a little per message (seen: 0.1% for one or two large calls; 1.5% for ZeRO-3's
    63 small ones, ~400 B each): within 3%, 5% for ZeRO-3."""
    r = compare[0]
    wire = {k: r["stages"][k]["wire"] for k in IMPLS}
    for k in IMPLS:
        rel = 0.05 if k == "zero3" else 0.03
        assert wire[k]["sent"] == pytest.approx(wire[k]["issued_gloo"], rel=rel), k
    assert wire["zero1"]["sent"] / wire["ddp"]["sent"] == pytest.approx(1.5, rel=0.03)
    assert wire["zero1"]["vs_ring"] == pytest.approx(1.5, rel=0.03)
    assert wire["ddp"]["vs_ring"] == pytest.approx(1.0, rel=0.03)


@pytest.mark.multirank
def test_every_stage_matches_the_one_process_reference(compare):
    """fp32 AdamW, lr 1e-3: the same updates as one process up to summation order (seen: 1e-6
    on the parameters). A rank that stepped on its own gradient instead of the average would be
    off by about lr = 1e-3 (Adam's first step moves a weight by ~lr in its gradient's sign)."""
    r0 = compare[0]
    for k in IMPLS:
        assert r0["loss_max_diff"][k] <= 1e-5, (k, r0["loss_max_diff"])
        assert r0["param_max_diff"][k] <= 1e-4, (k, r0["param_max_diff"])
        assert len(r0["losses"][k]) == len(r0["reference_losses"]) == 4
        assert r0["step_s"][k] > 0
    assert r0["step_vs_ddp"]["ddp"] == 1.0
    assert compare[1]["losses"] == r0["losses"]


@pytest.mark.multirank
def test_padding_is_all_that_separates_measured_from_predicted():
    """(And ZeRO-3 with compute_dtype=bf16.) h = 18 on 4 ranks: the norms (18) and the
    embeddings (1023 x 18) do not split into 4 equal parts. ZeRO-1/2 pad the one flat buffer
    of P = 40,122 elements to 40,124; ZeRO-3 pads five tensors by 2 elements each (10 in all,
    2.5 per rank). The bytes held and sent are then exactly the prediction plus the padding."""
    n, h, v = 4, 18, 1023
    layer = [h * h] * 4 + [h * 2 * h] * 3 + [h, h]      # q k v o (3 kv heads), MLP, norms
    sizes = [v * h, v * h, h] + layer
    P = sum(sizes)
    flat = -(-P // n) * n
    per_tensor = sum(-(-x // n) * n for x in sizes)
    assert (flat - P, per_tensor - P) == (2, 10)
    r = run_lab("labkit.labs.zero", nproc=n, timeout=240, quiet=True, args=[
        "--layers", "1", "--hidden", str(h), "--heads", "3", "--vocab", str(v), "--seq", "16",
        "--batch", "1", "--steps", "4", "--impl", "zero1", "--impl", "zero3",
        "--impl", "zero3_bf16"]).results[0]
    assert r["num_params"] == P
    z1, z3 = r["stages"]["zero1"], r["stages"]["zero3"]
    assert z1["measured"] == {"params": 4 * flat, "grads": 4 * P, "optimizer_states": 2 * flat}
    assert z3["measured"] == {"params": per_tensor, "grads": per_tensor,
                              "optimizer_states": 2 * per_tensor}
    for s in (z1, z3):
        assert s["ratio"]["optimizer_states"] > 1.0         # the padding is memory held
        assert set(s["ratio_padded"].values()) == {1.0} and s["ratio_payload_padded"] == 1.0
    assert z3["payload"] == 3 * 4 * per_tensor and z1["payload"] == 2 * 4 * flat
    # compute_dtype=bf16: the same fp32 states, the weights gathered in 2 bytes, not 4; the
    # gradients still reduce-scattered in fp32
    bf16 = r["stages"]["zero3_bf16"]
    assert bf16["measured"] == z3["measured"]
    assert {op: c["bytes"] for op, c in bf16["collectives"].items()} == {
        "all_gather": 2 * 2 * per_tensor, "reduce_scatter": 4 * per_tensor}
    assert bf16["ratio_payload_padded"] == 1.0
    assert 0 < r["param_max_diff"]["zero3_bf16"] < 0.05     # bf16 compute: close, not equal


def test_flags_are_checked(capsys):
    from labkit.labs.zero import parse_args

    for bad, words in ((["--steps", "3"], "--steps: 3 is too few; allowed: >= 4"),
                       (["--heads", "5"], "--heads: 5 does not divide --hidden 128"),
                       (["--heads", "8", "--kv-heads", "3"], "--kv-heads: 3 does not divide"),
                       (["--impl", "zero4"], "invalid choice: 'zero4'")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert words in capsys.readouterr().err
    assert parse_args(["--heads", "4"])[0].kv_heads == 2       # half, or all when odd
    assert parse_args(["--heads", "3", "--hidden", "96"])[0].kv_heads == 3
    assert parse_args(["--impl", "zero3", "--impl", "ddp"])[0].impl == ["zero3", "ddp"]


# ---------------------------------------------------------------------------------------------
# labkit.plots.zero

def test_figure1_reproduces_the_paper():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (bf16-mixed AdamW):
    (2+2+K)Psi, (2+2)Psi + K Psi/N_d, 2 Psi + (2+K) Psi/N_d, (2+2+K) Psi/N_d."""
    from labkit.plots.zero import figure1, figure1_rows

    psi, n = 7.5e9, 64
    rows = figure1_rows()
    want = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]
    assert [r["total"] for r in rows] == pytest.approx(want)
    assert [round(r["total"] / 1e9, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]
    assert [r["K"] for r in rows] == [12] * 4
    fig = figure1()
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.startswith("31.4 GB") for t in texts)


def test_holdings_picture_fills_what_each_stage_keeps():
    from matplotlib.patches import Rectangle

    from labkit.plots.zero import holdings_figure

    dp = 4
    fig = holdings_figure(dp=dp)
    filled = [sum(1 for p in ax.patches if isinstance(p, Rectangle) and p.get_facecolor()[:3]
                  != (1.0, 1.0, 1.0)) for ax in fig.axes]
    full = dp * dp            # a replicated state: every slice on every rank
    # DDP: 3 replicated states; each stage shards one more (each rank fills 1 slice of dp)
    assert filled == [3 * full, 2 * full + dp, full + 2 * dp, 3 * dp]
    with pytest.raises(ValueError, match="dp"):
        holdings_figure(dp=0)


@pytest.mark.multirank
def test_measured_bars_draws_the_lab_report(compare):
    from labkit.plots.zero import measured_bars

    fig = measured_bars(compare[0]["stages"], rank=0)
    assert [t.get_text() for t in fig.axes[0].texts][:4] == ["x1.000"] * 4
    with pytest.raises(ValueError, match="stages"):
        measured_bars({})


@pytest.mark.multirank
def test_communication_bars_draw_payload_and_wire(compare):
    from labkit.plots.zero import communication_bars

    stages = compare[0]["stages"]
    ax = communication_bars(stages).axes[0]
    heights = [round(p.get_height() * 1e6) for p in ax.patches]
    assert len(heights) == 4 * len(IMPLS)          # payload, predicted, ring, gloo per impl
    P, _ = llama()
    assert heights[:len(IMPLS)] == [4 * P, 8 * P, 8 * P, 12 * P, 8 * P]     # payloads
    with pytest.raises(ValueError, match="stages"):
        communication_bars([])


@pytest.mark.multirank
def test_bench_summary_reads_the_lab_report(compare, capsys):
    """Against DDP's 16 B per parameter on 2 ranks: ZeRO-1 keeps 4 + 4 + 8/2 = 12 (0.75),
    ZeRO-2 4 + 2 + 4 = 10 (0.625), ZeRO-3 8 (0.5); a ring sends DDP's bytes for stages 1 and
    2, 1.5x for stage 3 and for torch's all-reduce + broadcast."""
    from labkit.cli.bench_zero import main, summary

    s = summary(compare[0])
    memory = {k: v["memory"] for k, v in s.items()}
    assert memory.pop("torch_zero") == pytest.approx(0.75, rel=1e-3)   # whole tensors: uneven
    assert memory == {"ddp": 1.0, "zero1": 0.75, "zero2": 0.625, "zero3": 0.5}
    assert {k: v["wire"] for k, v in s.items()} == pytest.approx(
        {"ddp": 1.0, "zero1": 1.0, "zero2": 1.0, "zero3": 1.5, "torch_zero": 1.5})
    assert s["ddp"]["step"] == 1.0 and all(v["step"] > 0 for v in s.values())
    with pytest.raises(SystemExit):
        main(["--steps", "3"])
    assert "--steps: 3 is too few; allowed: >= 4" in capsys.readouterr().err
