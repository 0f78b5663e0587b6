"""labkit.hardware: units are explicit and consistent; numbers are the datasheets' dense ones."""
from __future__ import annotations

import pytest

from labkit.hardware import GB, GPUS, LINKS, GiB, get_gpu, get_link

REQUIRED_GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "a10g",
                 "t4")
REQUIRED_LINKS = ("nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "ib-hdr", "ib-ndr",
                  "eth-100g", "eth-400g", "loopback")


def test_required_entries_have_sources():
    for key in REQUIRED_GPUS:
        assert GPUS[key].source and GPUS[key].memory > 0 and GPUS[key].peak_flops
    for key in REQUIRED_LINKS:
        assert LINKS[key].source and LINKS[key].quoted and LINKS[key].latency > 0


def test_dense_peaks_from_datasheets():
    assert GPUS["a100-80gb"].peak_flops["bf16"] == 312e12
    assert GPUS["h100-sxm"].flops("bf16") == 989e12
    assert GPUS["h100-pcie"].flops("bf16") == 756e12
    assert GPUS["h200"].flops("bf16") == GPUS["h100-sxm"].flops("bf16")
    assert GPUS["b200"].flops("bf16") == 2.25e15
    assert GPUS["l4"].flops("bf16") == 121e12
    assert GPUS["t4"].flops("fp16") == 65e12
    with pytest.raises(ValueError, match="dtype='bf16' is not supported"):
        GPUS["t4"].flops("bf16")


def test_memory_is_bytes_from_the_label():
    assert GPUS["h100-sxm"].memory == 80e9
    assert GPUS["h200"].memory == 141e9
    assert GPUS["a100-40gb"].memory_gib == pytest.approx(40e9 / 2**30)
    assert GB == 1e9 and GiB == 2**30


def test_links_per_direction_vs_bidirectional():
    assert LINKS["nvlink3"].bandwidth == 300e9 and LINKS["nvlink3"].bidirectional == 600e9
    assert LINKS["nvlink4"].bandwidth == 450e9 and LINKS["nvlink4"].bidirectional == 900e9
    assert LINKS["nvlink5"].bandwidth == 900e9
    # Network ports are quoted in Gb/s per direction: 8 bits per byte.
    assert LINKS["ib-hdr"].bandwidth == 25e9 and "200 Gb/s" in LINKS["ib-hdr"].quoted
    assert LINKS["ib-ndr"].bandwidth == 50e9
    assert LINKS["eth-100g"].bandwidth == 12.5e9 and LINKS["eth-400g"].bandwidth == 50e9
    # PCIe: 128b/130b coding leaves 31.5 GB/s per direction of the "64 GB/s" quoted.
    assert LINKS["pcie4"].bandwidth == pytest.approx(31.5e9, rel=1e-3)
    assert LINKS["pcie5"].bandwidth == pytest.approx(63.0e9, rel=1e-3)
    for link in LINKS.values():
        assert link.bidirectional == pytest.approx(2 * link.bandwidth, rel=0.02)


def test_lookup_errors_list_what_is_allowed():
    assert get_gpu("H100-SXM") is GPUS["h100-sxm"]
    assert get_link(LINKS["ib-ndr"]) is LINKS["ib-ndr"]
    with pytest.raises(ValueError, match="gpu='v100' is not supported; allowed: 'a100-40gb'"):
        get_gpu("v100")
    with pytest.raises(ValueError, match="link='nvlink9'"):
        get_link("nvlink9")


def test_b200_tf32_is_the_hgx_datasheet_figure():
    # NVIDIA's HGX B200 datasheet: TF32 Tensor Core 18 PFLOPS for 8 GPUs, with sparsity.
    b200 = GPUS["b200"]
    assert b200.flops("tf32") == pytest.approx(18e15 / 8 / 2)
    assert "TF32 18 PFLOPS" in b200.source


def test_fp8_doubles_the_16_bit_peak_where_datasheets_give_it():
    # Hopper, Ada and Blackwell tensor cores: FP8 twice BF16 (dense and sparse alike);
    # Ampere and Turing have no FP8 mode.
    with_fp8 = [k for k, g in GPUS.items() if "fp8" in g.peak_flops]
    assert {"h100-sxm", "h100-pcie", "h200", "b200", "l4"} <= set(with_fp8)
    for key in with_fp8:
        # (datasheets round: H100 SXM FP8 1,979 against BF16 989, L4 FP8 485 against BF16 242
        # with sparsity)
        assert GPUS[key].flops("fp8") == pytest.approx(2 * GPUS[key].flops("bf16"), rel=5e-3), key
        assert "FP8" in GPUS[key].source, key
    for key in ("a100-80gb", "t4"):
        with pytest.raises(ValueError, match="dtype='fp8' is not supported"):
            GPUS[key].flops("fp8")
