"""GPU catalog: the capacity the driver really exposes, not the marketing number.

Facts from public nvidia-smi / torch.cuda / rocm-smi logs (see docs/plan.md). The planner
budgets from ``visible_bytes`` (what ``torch.cuda.mem_get_info`` reports on an idle card),
which is a little less than the HBM as sold.
"""

from __future__ import annotations

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
    """HBM bandwidth in GB/s."""
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
        GpuSpec("a100-80g", "A100 80GB SXM", 85_056_798_720, 2039, "NVLink3", 600, "PCIe4 x16", 312,
                aliases=("a100", "a100-80gb", "a100-sxm4-80gb")),
        GpuSpec("h100-80g", "H100 80GB SXM", 81_559 * MiB, 3350, "NVLink4", 900, "PCIe5 x16", 989,
                aliases=("h100", "h100-80gb", "h100-sxm", "h100-sxm5-80gb")),
        GpuSpec("h200", "H200 141GB SXM", 143_771 * MiB, 4800, "NVLink4", 900, "PCIe5 x16", 989,
                aliases=("h200-141g", "h200-sxm")),
        GpuSpec("b200", "B200 192GB (HGX)", 183_359 * MiB, 8000, "NVLink5", 1800, "PCIe5 x16", 2250,
                aliases=("b200-180g",)),
        GpuSpec("mi300x", "AMD Instinct MI300X 192GB", 205_822_885_888, 5300, "Infinity Fabric", 896, "PCIe5 x16",
                1307, vendor="amd", aliases=("mi300",)),
        GpuSpec("rtx4090", "GeForce RTX 4090 24GB", 24_564 * MiB, 1008, "PCIe", 32, "PCIe4 x16", 165,
                nvlink=False, aliases=("4090", "rtx-4090")),
        GpuSpec("rtx3090", "GeForce RTX 3090 24GB", 24_576 * MiB - 330 * MiB, 936, "PCIe (NVLink bridge optional)",
                32, "PCIe4 x16", 71, nvlink=False, aliases=("3090", "rtx-3090")),
        GpuSpec("l40s", "L40S 48GB", 46_068 * MiB, 864, "PCIe", 32, "PCIe4 x16", 362,
                nvlink=False, aliases=("l40s-48g",)),
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


def match_gpu_name(product_name: str) -> GpuSpec | None:
    """Map an NVML product name ('NVIDIA H100 80GB HBM3') to a catalog entry."""
    text = product_name.lower().replace(" ", "").replace("-", "")
    for key, needle in (
        ("h200", "h200"), ("b200", "b200"), ("h100-80g", "h100"), ("a100-80g", "a100"),
        ("mi300x", "mi300"), ("rtx4090", "4090"), ("rtx3090", "3090"), ("l40s", "l40s"),
    ):
        if needle in text:
            return GPUS[key]
    return None
