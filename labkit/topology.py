"""The interconnect a machine's GPUs talk over, read from `nvidia-smi topo -m`, and the bus
bandwidth an all-reduce across them should approach (layer 1: pure, no torch).

    from labkit.topology import parse_topology, expected_busbw, busbw_verdict
    topo = parse_topology(text_of_nvidia_smi_topo_m)       # {"gpus", "pairs", "slowest"}
    parse_pcie(text_of_query_gpu_index_gen_width)           # (slowest PCIe gen, narrowest width)
    expected_busbw(topo["slowest"], "NVIDIA H100 80GB HBM3")  # (bytes/s per direction, which link)
    busbw_verdict(measured, expected)                        # ("ok" | "warn" | "info", share)

A ring is as fast as its slowest hop, so the slowest GPU-to-GPU path decides; the link figures
are labkit.hardware.LINKS' (per direction). Used by `labkit workshop check`.
"""
from __future__ import annotations

import re

from labkit.hardware import GB, LINKS

# --- the interconnect --------------------------------------------------------------------------

# NVLink generation and links per GPU, by the GPU's name as torch reports it. Sources: the
# LINKS entries' quotes (A100: 12 links, Hopper and Blackwell: 18 links, each 2 x 25 or 2 x 50
# GB/s); the per-GPU totals themselves are LINKS[...].bandwidth.
NVLINK_BY_GPU = (("A100", "nvlink3", 12), ("A800", "nvlink3", 12), ("H100", "nvlink4", 18),
                 ("H200", "nvlink4", 18), ("H800", "nvlink4", 18), ("GH200", "nvlink4", 18),
                 ("B200", "nvlink5", 18), ("B100", "nvlink5", 18))
PCIE_BY_GEN = {4: "pcie4", 5: "pcie5"}
# The paths of `nvidia-smi topo -m`'s legend, slowest first: a ring is as fast as its slowest hop.
PCIE_PATHS = ("SYS", "NODE", "PHB", "PXB", "PIX")
# A healthy all-reduce reaches most of the link (nccl-tests: ~80 % on NVLink and PCIe at large
# sizes); below this share something is off (peer-to-peer disabled, a link down, a busy GPU).
BUSBW_OK_SHARE = 0.5
BUSBW_SIZE = "256M"     # large enough for the bandwidth term to dominate (nccl-tests' plateau)


# Current drivers underline the matrix's header row ("\t\x1b[4mGPU0\tGPU1 ... GPU NUMA ID\x1b[0m"),
# also when stdout is a pipe: terminal escape sequences are removed before reading.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def visible_indices(cuda_visible_devices: str | None, count: int) -> list[int] | None:
    """The nvidia-smi indices of the `count` GPUs torch sees under CUDA_VISIBLE_DEVICES (a
    comma-separated list of indices; CUDA stops at the first invalid one), or None when every
    GPU is visible or the list names GPUs by UUID (then the whole matrix is read). nvidia-smi
    numbers GPUs in PCI bus order, as CUDA does on a machine of identical GPUs (on a mixed one
    only with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    if cuda_visible_devices is None or not cuda_visible_devices.strip():
        return None
    out = []
    for word in cuda_visible_devices.split(","):
        if not word.strip().isdigit():
            return None if not out else out[:count]
        out.append(int(word))
    return out[:count]


def parse_topology(text: str, visible: list[int] | None = None) -> dict:
    """`nvidia-smi topo -m`'s matrix: {"gpus": ["GPU0", ...], "pairs": {"GPU0-GPU1": "NV18"},
    "slowest": the slowest GPU-to-GPU path ("NV18", "SYS", ...; None with fewer than 2 GPUs)}.
    visible: nvidia-smi indices of the GPUs the labs use (`visible_indices`); None: all."""
    lines = [ln for ln in strip_ansi(text).splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s+GPU0\b", ln)), None)
    if header is None:
        return {"gpus": [], "pairs": {}, "slowest": None}
    cols = [c.strip() for c in header.strip().split("\t")] if "\t" in header else header.split()
    keep = None if visible is None else {f"GPU{i}" for i in visible}
    pairs, gpus = {}, []
    for ln in lines:
        m = re.match(r"^(GPU\d+)\s", ln)
        if not m or (keep is not None and m.group(1) not in keep):
            continue
        gpus.append(m.group(1))
        cells = [c.strip() for c in ln.split("\t")[1:]] if "\t" in ln else ln.split()[1:]
        for col, cell in zip(cols, cells):
            if re.fullmatch(r"GPU\d+", col) and col != m.group(1) and cell != "X" \
                    and (keep is None or col in keep):
                pairs["-".join(sorted((m.group(1), col)))] = cell
    return {"gpus": gpus, "pairs": pairs, "slowest": min(pairs.values(), key=_path_rank)
            if pairs else None}


def parse_pcie(text: str | None, visible: list[int] | None = None) -> tuple[int | None, int | None]:
    """(the lowest PCIe generation, the narrowest width) among the GPUs of `nvidia-smi
    --query-gpu=index,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader,nounits`
    (a ring is as fast as its slowest link); visible as in parse_topology. (None, None) where
    nothing could be read ("[N/A]", a MIG instance)."""
    gens, widths = [], []
    for line in strip_ansi(text or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            continue
        index, gen, width = map(int, parts)
        if visible is None or index in visible:
            gens.append(gen)
            widths.append(width)
    return (min(gens) if gens else None), (min(widths) if widths else None)


def _path_rank(path: str) -> tuple[int, int]:
    m = re.fullmatch(r"NV(\d+)", path)
    if m:
        return (len(PCIE_PATHS), int(m.group(1)))
    return (PCIE_PATHS.index(path) if path in PCIE_PATHS else -1, 0)


def expected_busbw(slowest: str | None, gpu_name: str, pcie_gen: int | None = None,
                   pcie_width: int | None = None) -> tuple[float | None, str]:
    """(bytes/s per direction an all-reduce's busbw should approach, which link that is), from
    the slowest GPU-to-GPU path of the topology, or (None, why not)."""
    if slowest is None:
        return None, "fewer than 2 GPUs: no GPU-to-GPU link"
    m = re.fullmatch(r"NV(\d+)", slowest)
    if m:
        gen = next(((key, links) for part, key, links in NVLINK_BY_GPU
                    if part in gpu_name.upper()), None)
        if gen is None:
            return None, (f"{slowest} (NVLink) on {gpu_name}: its generation is not in "
                          "labkit.hardware.LINKS' table of GPUs")
        link = LINKS[gen[0]]
        links = int(m.group(1))
        bw = min(links, gen[1]) * link.bandwidth / gen[1]
        return bw, f"{slowest}: {links} x {link.name} link(s), {bw / GB:.0f} GB/s per direction"
    if slowest in PCIE_PATHS:
        key = PCIE_BY_GEN.get(pcie_gen or 0)
        if key is None:
            return None, (f"{slowest} (PCIe{f' gen {pcie_gen}' if pcie_gen else ''}): no such "
                          "PCIe generation in labkit.hardware.LINKS")
        link = LINKS[key]
        width = pcie_width if pcie_width in (1, 2, 4, 8, 16) else 16
        bw = link.bandwidth * width / 16
        via = " across the CPUs' interconnect" if slowest in ("SYS", "NODE") else ""
        return bw, f"{slowest}: {link.name[:-4]}x{width}{via}, {bw / GB:.1f} GB/s per direction"
    return None, f"path {slowest!r} is not one of nvidia-smi's (NV#, {', '.join(PCIE_PATHS)})"


def busbw_verdict(measured: float, expected: float | None) -> tuple[str, float | None]:
    """("ok" | "warn" | "info", measured / expected)."""
    if not expected:
        return "info", None
    share = measured / expected
    return ("ok" if share >= BUSBW_OK_SHARE else "warn"), share
