"""Hardware numbers in one table, each with its source: `GPUS` and `LINKS`.

    >>> get_gpu("h100-sxm").flops("bf16"), get_gpu("h100-sxm").memory   # dense FLOP/s, bytes
    >>> get_link("nvlink4").bandwidth                                    # bytes/s per direction

Units, everywhere in this module: memory in bytes read from the label's GB (1e9), compute in
dense FLOP/s, link bandwidth in bytes/s per direction, latency in seconds (an order of
magnitude: measure yours with `labkit bench`). Why each convention: above `GPU` and `Link`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit import validate

GB = 1e9
GiB = 2**30
T = 1e12


# Memory in bytes, read from the vendor's capacity label with GB = 1e9 (so "80 GB" -> 80e9
# bytes). This is a conservative convention: an H100 80GB reports 79.11 GiB (84.9e9 bytes) to
# `torch.cuda.get_device_properties(0).total_memory`, an A100 80GB 79.15 GiB and an A100 40GB
# 39.59 GiB (the totals PyTorch's out-of-memory messages print on those cards), of which the CUDA
# context and the caching allocator take some. A memory figure within the label's bytes fits on
# the device. `GPU.memory_gib` gives the same number in GiB. `GPU.device_bytes` is what the
# device reports where it is known (the label's bytes otherwise): the planner takes its headroom
# (`labkit.planner.usable_memory`) from those real bytes, not from the label.
# Compute in FLOP/s, *dense* (NVIDIA's datasheets print tensor-core figures "with sparsity",
# 2:4 structured sparsity, which is exactly twice the dense figure; training uses dense).
@dataclass(frozen=True)
class GPU:
    name: str
    memory: float                      # bytes (label GB x 1e9)
    peak_flops: dict = field(default_factory=dict)   # dtype -> dense FLOP/s
    memory_bandwidth: float = 0.0      # HBM/GDDR bytes/s
    source: str = ""
    device_memory: float = 0.0         # bytes torch's total_memory reports; 0: not known

    @property
    def memory_gib(self) -> float:
        return self.memory / GiB

    @property
    def device_bytes(self) -> float:
        """The bytes the device reports (torch's `total_memory`), or the label's if not known."""
        return self.device_memory or self.memory

    def flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for `dtype`; ValueError if this GPU has no such tensor-core mode."""
        return self.peak_flops[validate.choice("dtype", dtype, self.peak_flops)]


# Link bandwidth in bytes/s *per direction* (`Link.bandwidth`); `Link.bidirectional` is the sum
# of both directions, the figure NVLink and PCIe marketing quote; `Link.quoted` keeps the
# vendor's own words and units (Gb/s for network ports, which are per direction, 8 bits/byte).
# Latency in seconds: a typical one-message latency (the alpha of an alpha-beta model). These
# are orders of magnitude, not vendor specifications; measure yours with `labkit bench`.
@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float        # bytes/s, per direction
    bidirectional: float    # bytes/s, both directions added (what NVLink/PCIe specs quote)
    quoted: str             # the vendor's figure in the vendor's words and units
    latency: float          # seconds, typical order of magnitude (alpha)
    scope: str              # "intra-node" | "inter-node" | "host"
    source: str = ""


_A100 = {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T,
         "int8": 624 * T}
_A100_SRC = ("NVIDIA A100 Tensor Core GPU datasheet (SXM): dense FP64 Tensor Core 19.5 (FP64 "
             "9.7 without tensor cores), FP32 19.5 (no tensor cores), TF32 156, BF16/FP16 312 "
             "TFLOPS, INT8 624 TOPS; the datasheet's starred figures (TF32 312, BF16/FP16 624, "
             "INT8 1,248) are with sparsity")
_H100_SXM = {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989 * T, "fp16": 989 * T,
             "fp8": 1979 * T, "int8": 1979 * T}
_H100_SRC = ("NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16/FP16 1,979, FP8 3,958, TF32 989 "
             "TFLOPS with sparsity; dense is half (BF16 989 TFLOPS)")

GPUS: dict[str, GPU] = {
    "a100-40gb": GPU("NVIDIA A100 40GB SXM", 40 * GB, _A100, 1555 * GB, _A100_SRC,
                     39.59 * GiB),
    "a100-80gb": GPU("NVIDIA A100 80GB SXM", 80 * GB, _A100, 2039 * GB, _A100_SRC,
                     79.15 * GiB),
    "h100-sxm": GPU("NVIDIA H100 SXM 80GB", 80 * GB, _H100_SXM, 3350 * GB, _H100_SRC,
                    79.11 * GiB),
    "h100-pcie": GPU(
        "NVIDIA H100 PCIe 80GB", 80 * GB,
        {"fp64": 51 * T, "fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T,
         "fp8": 1513 * T, "int8": 1513 * T}, 2000 * GB,
        "NVIDIA H100 datasheet (PCIe): BF16 1,513, FP8 3,026 TFLOPS with sparsity; dense is half"),
    "h200": GPU("NVIDIA H200 SXM 141GB", 141 * GB, _H100_SXM, 4800 * GB,
                "NVIDIA H200 datasheet (SXM): same tensor cores as H100 SXM (BF16 1,979 and FP8 "
                "3,958 TFLOPS with sparsity, 989 and 1,979 dense), 141 GB HBM3e, 4.8 TB/s",
                139.80 * GiB),
    "b200": GPU(
        "NVIDIA B200 (HGX/DGX B200, per GPU)", 180 * GB,
        {"fp64": 37 * T, "fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp16": 2250 * T,
         "fp8": 4500 * T, "int8": 4500 * T}, 7700 * GB,
        "NVIDIA HGX B200 datasheet, 8 GPUs: TF32 18 PFLOPS, FP16/BF16 36 PFLOPS, FP8 72 PFLOPS "
        "with sparsity; per GPU: TF32 2.25, FP16/BF16 4.5, FP8 9 PFLOPS with sparsity (dense "
        "1.125, 2.25 and 4.5), 180 GB HBM3e (1,440 GB per DGX B200), "
        "7.7 TB/s; the 1,000 W HGX configuration, not the 1,200 W GB200 part"),
    "l4": GPU("NVIDIA L4 24GB", 24 * GB,
              {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T,
               "fp8": 242.5 * T, "int8": 242.5 * T}, 300 * GB,
              "NVIDIA L4 datasheet: BF16/FP16 242, FP8 485, TF32 120 TFLOPS with sparsity; "
              "dense is half"),
    "a10g": GPU("NVIDIA A10G 24GB (AWS G5)", 24 * GB,
                {"fp32": 35 * T, "tf32": 35 * T, "bf16": 70 * T, "fp16": 70 * T}, 600 * GB,
                "AWS-only part (G5 instances): NVIDIA publishes no datasheet for it. Figures "
                "from a third-party spec comparison (Baseten, 'NVIDIA A10 vs A10G for ML model "
                "inference'): FP32 35, TF32 35, BF16/FP16 70 TFLOPS dense; 24 GB GDDR6, "
                "600 GB/s. Approximate. Not the NVIDIA A10, whose datasheet says FP32 31.2, "
                "TF32 62.5, BF16/FP16 125 TFLOPS dense (250 with sparsity)"),
    "t4": GPU("NVIDIA T4 16GB", 16 * GB,
              {"fp32": 8.1 * T, "fp16": 65 * T, "int8": 130 * T}, 320 * GB,
              "NVIDIA T4 datasheet: FP16/FP32 mixed 65 TFLOPS, FP32 8.1, INT8 130 TOPS; Turing "
              "has no BF16 tensor cores"),
}

# PCIe: 16 GT/s (Gen4) or 32 GT/s (Gen5) per lane, 16 lanes, 128b/130b line code.
_PCIE4 = 16e9 * 16 * 128 / 130 / 8      # 31.5e9 bytes/s per direction
_PCIE5 = 32e9 * 16 * 128 / 130 / 8      # 63.0e9

LINKS: dict[str, Link] = {
    "nvlink3": Link("NVLink 3 (A100)", 300 * GB, 600 * GB,
                    "600 GB/s total bandwidth per GPU (12 links x 50 GB/s bidirectional)",
                    2e-6, "intra-node", "NVIDIA A100 datasheet / Ampere architecture whitepaper"),
    "nvlink4": Link("NVLink 4 (H100/H200)", 450 * GB, 900 * GB,
                    "900 GB/s total bandwidth per GPU (18 links x 50 GB/s bidirectional)",
                    2e-6, "intra-node", "NVIDIA H100 datasheet / Hopper architecture whitepaper"),
    "nvlink5": Link("NVLink 5 (B200)", 900 * GB, 1800 * GB,
                    "1.8 TB/s total bandwidth per GPU (18 links x 100 GB/s bidirectional)",
                    2e-6, "intra-node", "NVIDIA Blackwell datasheets (HGX/DGX B200)"),
    "pcie4": Link("PCIe 4.0 x16", _PCIE4, 64 * GB,
                  "64 GB/s (x16, both directions; 16 GT/s per lane)", 2e-6, "intra-node",
                  "PCI-SIG PCIe 4.0 base specification (16 GT/s, 128b/130b)"),
    "pcie5": Link("PCIe 5.0 x16", _PCIE5, 128 * GB,
                  "128 GB/s (x16, both directions; 32 GT/s per lane)", 2e-6, "intra-node",
                  "PCI-SIG PCIe 5.0 base specification (32 GT/s, 128b/130b)"),
    "ib-hdr": Link("InfiniBand HDR (1 port)", 200e9 / 8, 2 * 200e9 / 8,
                   "200 Gb/s per port (each direction)", 2e-6, "inter-node",
                   "NVIDIA/Mellanox ConnectX-6 HDR InfiniBand product brief"),
    "ib-ndr": Link("InfiniBand NDR (1 port)", 400e9 / 8, 2 * 400e9 / 8,
                   "400 Gb/s per port (each direction)", 2e-6, "inter-node",
                   "NVIDIA ConnectX-7 NDR InfiniBand product brief"),
    "eth-100g": Link("100 Gigabit Ethernet", 100e9 / 8, 2 * 100e9 / 8,
                     "100 Gb/s (each direction)", 10e-6, "inter-node", "IEEE 802.3 (100GBASE)"),
    "eth-400g": Link("400 Gigabit Ethernet", 400e9 / 8, 2 * 400e9 / 8,
                     "400 Gb/s (each direction)", 10e-6, "inter-node", "IEEE 802.3bs (400GBASE)"),
    "loopback": Link("TCP loopback (gloo on one CPU host)", 5 * GB, 10 * GB,
                     "no vendor figure: an order of magnitude for TCP over 127.0.0.1", 20e-6,
                     "host", "order of magnitude on a laptop; measure yours with labkit bench"),
}


def _lookup(name: str, value, table: dict, cls):
    """An entry of `table` from its key (any case) or the entry itself."""
    if isinstance(value, cls):
        return value
    key = str(value).lower()
    validate.choice(name, key, table)
    return table[key]


def get_gpu(gpu) -> GPU:
    """A GPU from its key in GPUS (e.g. "h100-sxm") or a GPU object."""
    return _lookup("gpu", gpu, GPUS, GPU)


def get_link(link) -> Link:
    """A Link from its key in LINKS (e.g. "nvlink4") or a Link object."""
    return _lookup("link", link, LINKS, Link)
