"""GPU catalog: the capacity the driver really exposes, not the marketing number.

Each entry's memory is what the driver reports as the card's total (the total ``nvidia-smi``
prints, or torch's ``total_memory`` where the entry says so; ``rocm-smi``'s for AMD), a little
less than the memory as sold. Bandwidths and dense BF16 throughput are the vendor datasheet's figures, cited
beside each entry; where a datasheet gives the BF16 figure "with sparsity" only, the dense one is
half of it. ``p2p_bandwidth_gbs`` is what one GPU exchanges with its peers in an 8-GPU node, both
directions together: the NVLink figure where the cards are NVLinked, else the PCIe link's (an
NVLink bridge joins only two PCIe cards, so a collective over more crosses PCIe).

A card is named by its key or an alias, and an alias never names a card with other memory than
the name says (``a100`` is refused: it is 40 or 80 GB). A card not in the catalog is refused with
the keys that describe it instead (:func:`unknown_gpu_message`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from orbitctl.units import GiB, MiB


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of the catalog: the memory a process sees, bandwidths, links and dense BF16 throughput."""

    name: str
    """Catalog key used in profiles (``hardware.gpu``)."""
    marketing: str
    visible_bytes: int
    """Memory the driver exposes to one process (torch's total_memory)."""
    hbm_bandwidth_gbs: float
    """HBM (GDDR on the PCIe cards) bandwidth in GB/s."""
    interconnect: str
    p2p_bandwidth_gbs: float
    """GPU-to-GPU bandwidth per GPU, bidirectional, GB/s."""
    host_link: str
    bf16_tflops: float
    """Dense BF16 tensor throughput (TFLOP/s), for rough time estimates."""
    vendor: str = "nvidia"
    nvlink: bool = True
    aliases: tuple[str, ...] = ()


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # NVIDIA A100 Tensor Core GPU datasheet: 40GB SXM 1,555 GB/s, BF16 312 TFLOPS
        # (624 sparse), NVLink 600 GB/s, PCIe Gen4 64 GB/s; nvidia-smi: A100-SXM4-40GB 40,960 MiB
        GpuSpec("a100-40g", "A100 40GB SXM", 40_960 * MiB, 1555, "NVLink3", 600, "PCIe4 x16", 312,
                aliases=("a100-40gb", "a100-sxm4-40gb")),
        # the same datasheet: 80GB SXM 2,039 GB/s; the memory as torch's total_memory reports it
        GpuSpec("a100-80g", "A100 80GB SXM", 85_056_798_720, 2039, "NVLink3", 600, "PCIe4 x16", 312,
                aliases=("a100-80gb", "a100-sxm4-80gb")),
        # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 80GB, 3.35 TB/s, BF16 1,979 TFLOPS sparse (989 dense),
        # NVLink 900 GB/s, PCIe Gen5 128 GB/s; nvidia-smi: H100 80GB HBM3 81,559 MiB. 'h100' is this card, the one of
        # every 8-GPU HGX/DGX H100 (the PCIe card has the same 81,559 MiB; the NVL's 94 GB is h100-nvl)
        GpuSpec("h100-80g", "H100 80GB SXM", 81_559 * MiB, 3350, "NVLink4", 900, "PCIe5 x16", 989,
                aliases=("h100", "h100-80gb", "h100-sxm", "h100-sxm5-80gb")),
        # the same datasheet (H100 PCIe): 80GB, 2 TB/s, BF16 1,513 TFLOPS sparse (756 dense), NVLink bridge 600 GB/s
        # for two cards, PCIe Gen5 128 GB/s; nvidia-smi: H100 PCIe 81,559 MiB
        GpuSpec("h100-pcie", "H100 80GB PCIe", 81_559 * MiB, 2000, "PCIe (NVLink bridge: pairs)", 128, "PCIe5 x16",
                756, nvlink=False, aliases=("h100-pcie-80g", "h100-pcie-80gb")),
        # the same datasheet (H100 NVL): 94GB, 3.9 TB/s, BF16 1,671 TFLOPS sparse (835 dense), NVLink bridge 600 GB/s
        # for two cards, PCIe Gen5 128 GB/s; nvidia-smi: H100 NVL 95,830 MiB
        GpuSpec("h100-nvl", "H100 NVL 94GB", 95_830 * MiB, 3900, "PCIe (NVLink bridge: pairs)", 128, "PCIe5 x16",
                835, nvlink=False, aliases=("h100-nvl-94g", "h100-94g")),
        # NVIDIA H800 Tensor Core GPU datasheet (SXM): 80GB, 3.35 TB/s, BF16 1,979 TFLOPS sparse (989 dense), NVLink
        # 400 GB/s; nvidia-smi: H800 81,559 MiB
        GpuSpec("h800", "H800 80GB SXM", 81_559 * MiB, 3350, "NVLink4 (400 GB/s)", 400, "PCIe5 x16", 989,
                aliases=("h800-80g", "h800-sxm")),
        # NVIDIA H20 product brief: 96GB HBM3, 4.0 TB/s, BF16 148 TFLOPS, NVLink 900 GB/s, PCIe Gen5 128 GB/s;
        # nvidia-smi: H20 97,871 MiB
        GpuSpec("h20", "H20 96GB", 97_871 * MiB, 4000, "NVLink4", 900, "PCIe5 x16", 148,
                aliases=("h20-96g",)),
        # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 141GB, 4.8 TB/s, BF16 1,979 TFLOPS sparse (989 dense),
        # NVLink 900 GB/s; nvidia-smi: H200 143,771 MiB
        GpuSpec("h200", "H200 141GB SXM", 143_771 * MiB, 4800, "NVLink4", 900, "PCIe5 x16", 989,
                aliases=("h200-141g", "h200-sxm")),
        # NVIDIA HGX B200 datasheet: 8 GPUs, 1.4 TB HBM3e, 64 TB/s (8 TB/s each), FP16/BF16 36 PFLOPS sparse
        # (2.25 PFLOPS dense each), NVLink5 1.8 TB/s per GPU; nvidia-smi: B200 183,359 MiB
        GpuSpec("b200", "B200 192GB (HGX)", 183_359 * MiB, 8000, "NVLink5", 1800, "PCIe5 x16", 2250,
                aliases=("b200-180g",)),
        # AMD Instinct MI300X data sheet: 192GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS dense, Infinity Fabric 896 GB/s
        # per GPU (7 links x 128 GB/s); rocm-smi's VRAM total
        GpuSpec("mi300x", "AMD Instinct MI300X 192GB", 205_822_885_888, 5300, "Infinity Fabric", 896, "PCIe5 x16",
                1307, vendor="amd", aliases=("mi300x-192g",)),
        # NVIDIA L4 Tensor Core GPU datasheet: 24GB GDDR6, 300 GB/s, BF16 242 TFLOPS sparse (121 dense), PCIe Gen4
        # x16 64 GB/s, no NVLink; nvidia-smi: L4 23,034 MiB
        GpuSpec("l4", "L4 24GB", 23_034 * MiB, 300, "PCIe", 64, "PCIe4 x16", 121,
                nvlink=False, aliases=("l4-24g",)),
        # NVIDIA A10G (AWS G5): no NVIDIA datasheet of its own; AWS gives 24GB GDDR6 at 600 GB/s (the A10's), its
        # tensor rate is below the A10 datasheet's 125 BF16 TFLOPS: 70 dense; PCIe Gen4 x16 64 GB/s; nvidia-smi:
        # A10G 23,028 MiB
        GpuSpec("a10g", "A10G 24GB (AWS)", 23_028 * MiB, 600, "PCIe", 64, "PCIe4 x16", 70,
                nvlink=False, aliases=("a10g-24g",)),
        # NVIDIA L40S datasheet: 48GB GDDR6, 864 GB/s, BF16 733 TFLOPS sparse (362 dense), PCIe Gen4 x16 64 GB/s,
        # no NVLink; nvidia-smi: L40S 46,068 MiB (ECC on)
        GpuSpec("l40s", "L40S 48GB", 46_068 * MiB, 864, "PCIe", 64, "PCIe4 x16", 362,
                nvlink=False, aliases=("l40s-48g",)),
        # NVIDIA RTX 6000 Ada Generation datasheet: 48GB GDDR6, 960 GB/s, 1,457 tensor TFLOPS (FP8 sparse: BF16
        # 364 dense), PCIe Gen4 x16 64 GB/s, no NVLink; nvidia-smi: RTX 6000 Ada 49,140 MiB
        GpuSpec("rtx6000-ada", "RTX 6000 Ada Generation 48GB", 49_140 * MiB, 960, "PCIe", 64, "PCIe4 x16", 364,
                nvlink=False, aliases=("rtx-6000-ada", "rtx6000ada", "6000-ada")),
        # NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): 24GB GDDR6X, 1,008 GB/s, BF16 with FP32
        # accumulate 165 TFLOPS dense; PCIe Gen4 x16. GeForce cards have no peer-to-peer: a transfer between two
        # crosses host memory, so half the link's 64 GB/s; nvidia-smi: RTX 4090 24,564 MiB
        GpuSpec("rtx4090", "GeForce RTX 4090 24GB", 24_564 * MiB, 1008, "PCIe", 32, "PCIe4 x16", 165,
                nvlink=False, aliases=("4090", "rtx-4090")),
        # NVIDIA Ampere GA102 whitepaper (GeForce RTX 3090): 24GB GDDR6X, 936 GB/s, BF16 with FP32 accumulate
        # 71 TFLOPS dense; PCIe Gen4 x16, no peer-to-peer (as the 4090)
        GpuSpec("rtx3090", "GeForce RTX 3090 24GB", 24_576 * MiB - 330 * MiB, 936, "PCIe (NVLink bridge optional)",
                32, "PCIe4 x16", 71, nvlink=False, aliases=("3090", "rtx-3090")),
        GpuSpec("cpu", "CPU only (no accelerator)", 16 * GiB, 50, "none", 0, "none", 1,
                vendor="cpu", nvlink=False),
    )
}

_ALIASES = {alias: g.name for g in GPUS.values() for alias in (g.name, *g.aliases)}


def resolve_gpu(name: str) -> GpuSpec | None:
    """Look a GPU up by catalog name or alias, case-insensitively."""
    key = _ALIASES.get(name.strip().lower())
    return GPUS[key] if key else None


def gpu_names() -> list[str]:
    return sorted(GPUS)


def memory_gib(spec: GpuSpec) -> float:
    """The memory a process sees on ``spec``, GiB."""
    return spec.visible_bytes / GiB


def unknown_gpu_message(name: str) -> str:
    """Why ``name`` is refused as ``hardware.gpu``, with the keys that describe a card the catalog lacks.

    The cards named as suggestions (those whose key starts with ``name``, else the closest spellings) come
    with their memory, so that a suggestion is never taken for the same card."""
    text = name.strip().lower()
    names = gpu_names()
    close = [n for n in names if text and n.startswith(text)] or difflib.get_close_matches(text, names, n=2)
    hint = ""
    if close:
        shown = " or ".join(f"'{n}' ({memory_gib(GPUS[n]):.1f} GiB)" for n in close)
        hint = f"; did you mean {shown}?"
    return (f"unknown GPU '{name}'{hint} For a card not in the catalog, set hardware.gpu to the listed card "
            f"closest in BF16 TFLOPS and memory bandwidth, hardware.gpu_memory_gib to its memory in GiB (nvidia-smi's "
            f"total MiB / 1024) and, for its own rates, hardware.calibration (orbitctl plan PROFILE --calibrate on "
            f"the card); known: {', '.join(names)}")


_NVML_NAMES: tuple[tuple[str, str], ...] = (
    # (catalog key, substring of the NVML product name with spaces and dashes removed), most specific first:
    # 'h200' before 'h20', 'a100...40gb' before 'a100', 'l40s' before 'l4'
    ("h200", "h200"), ("b200", "b200"), ("h100-nvl", "h100nvl"), ("h100-pcie", "h100pcie"), ("h100-80g", "h100"),
    ("h800", "h800"), ("h20", "h20"), ("a100-40g", "40gb"), ("a100-80g", "a100"), ("a10g", "a10g"),
    ("mi300x", "mi300"), ("rtx6000-ada", "rtx6000ada"), ("rtx4090", "4090"), ("rtx3090", "3090"), ("l40s", "l40s"),
)


def match_gpu_name(product_name: str) -> GpuSpec | None:
    """Map an NVML product name ('NVIDIA H100 80GB HBM3') to a catalog entry."""
    text = product_name.lower().replace(" ", "").replace("-", "")
    for key, needle in _NVML_NAMES:
        if needle in text and (key != "a100-40g" or "a100" in text):
            return GPUS[key]
    if text.endswith("l4"):  # 'NVIDIA L4'; an L40 or L40S is not one
        return GPUS["l4"]
    return None
