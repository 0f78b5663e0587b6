"""Tier 5: GPU-only checks, skipped without CUDA (`make test-gpu` on a GPU machine). They run the
same labs as the CPU tiers, over NCCL, and compare CUDA's own memory figures with the model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def test_doctor_sees_the_gpus_and_nccl():
    from labkit.course import doctor

    report = doctor.run_checks(launch=False)
    assert report["gpus"].status == "ok"
    assert report["gpus"].data["count"] == torch.cuda.device_count()
    assert report["nccl"].status == "ok" and report["nccl"].data["version"]
    # one rank per GPU from 2 GPUs up; a 1-GPU machine's default ranks (>= 2) share CPU, gloo
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert report["lab defaults"].data["backend"] == expected


@pytest.mark.parametrize("launcher", ["pool", "torchrun"])
def test_hello_lab_all_reduces_over_nccl(launcher):
    """From the warm pool too: its parent never initialised CUDA, so forked ranks can."""
    from labkit.runtime.launch import run_lab

    n = torch.cuda.device_count()
    result = run_lab("labkit.labs.hello", nproc=n, timeout=180, quiet=True, launcher=launcher)
    assert result.launcher == launcher
    assert [r["backend"] for r in result.results] == ["nccl"] * n
    assert [r["device"] for r in result.results] == [f"cuda:{i}" for i in range(n)]
    assert all(r["all_reduce"] == n * (n + 1) / 2 for r in result.results)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_memory_lab_on_cuda_matches_the_model(precision):
    """Model states exact; peak CUDA memory at least what the model predicts it must hold
    (states + saved activations), and printed beside it with the ratio."""
    from labkit.runtime.launch import run_lab

    r = run_lab("labkit.labs.memory", nproc=1, args=["--precision", precision], timeout=300,
                quiet=True).results[0]
    assert r["device"].startswith("cuda")
    for term in ("params", "grads", "optimizer_states"):
        assert r["ratio"][term] == 1.0, (term, r["measured"][term], r["predicted"][term])
    assert abs(r["ratio"]["activations"] - 1) <= 0.10
    assert r["peak_cuda"] >= sum(r["measured"][t] for t in ("params", "grads", "optimizer_states"))
    print(f"{precision}: peak CUDA {r['peak_cuda']:,} B vs predicted {r['predicted_total']:,.0f} B "
          f"(ratio {r['peak_cuda'] / r['predicted_total']:.3f}; temporaries are not in the model)")


def test_bf16_matmul_runs_on_this_gpu():
    assert torch.cuda.is_bf16_supported()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close((a @ a.T).float(), a.float() @ a.float().T, rtol=2e-2, atol=1.0)


def test_a_cuda_profiler_trace_is_read_as_gpu_kernels(tmp_path):
    """Module 11 on a GPU: a CUDA step's trace is classified by its kernels (compute here; NCCL
    kernels would be communication), with the CPU ops ignored."""
    from torch.profiler import ProfilerActivity, profile

    from labkit import trace

    x = torch.randn(2048, 2048, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            x = (x @ x).tanh()
        torch.cuda.synchronize()
    path = tmp_path / "cuda.json"
    prof.export_chrome_trace(str(path))
    s = trace.summarize(path)
    assert s.gpu and s.compute_s > 0 and s.comm_s == 0, s.text()


def test_fp8_casts_on_cuda_equal_the_cpus():
    """labkit.fp8's measurements are the same numbers on a GPU: the casts round alike."""
    from labkit import fp8

    x = torch.randn(256, 384) * 20
    for dtype in fp8.DTYPES:
        for scaling in fp8.SCALINGS:
            q, s = fp8.quantize(x, dtype, scaling)
            qg, sg = fp8.quantize(x.cuda(), dtype, scaling)
            assert torch.equal(q.float(), qg.float().cpu()), (dtype, scaling)
            assert torch.allclose(s, sg.cpu()), (dtype, scaling)


def test_torchao_float8_linear_error_is_near_bf16s():
    """Where torchao is installed and the GPU multiplies FP8 (compute capability 8.9+)."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability >= 8.9 (Ada, Hopper)")
    from labkit import fp8

    err = fp8.torchao_linear_error(size=2048, tokens=2048)
    print(f"relative output error vs fp32: bf16 {err['bf16']:.4f}, float8 {err['float8']:.4f}")
    assert err["bf16"] < err["float8"] < 0.1


def test_ranks_that_stay_run_on_cuda_and_measure_its_peak():
    """%ranks over NCCL, one rank per GPU: a CUDA tensor kept between cells, its value back on
    the CPU, and the cell's CUDA peak at least the 64 MiB it allocated."""
    from labkit.runtime.world import World

    n = torch.cuda.device_count()
    w = World(n, backend="nccl", device="cuda", timeout=120).start(show=lambda *a: None)
    try:
        w.run("x = torch.ones(4, device=device) * (rank + 1)")
        r = w.run("dist.all_reduce(x)\nbig = torch.empty(16 * 2**20, device=device)\ndel big\nx")
        assert w.backend_used == "nccl" and w.device_used == "cuda"
        assert all(v.device.type == "cpu" and v.tolist() == [n * (n + 1) / 2] * 4
                   for v in r.values.values())
        assert all(rc.cuda_peak >= 64 * 2**20 for rc in r.by_rank.values())
        assert all(rc.collectives["all_reduce"] == (1, 16) for rc in r.by_rank.values())
    finally:
        w.stop()
