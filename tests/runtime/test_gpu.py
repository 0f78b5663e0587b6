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
