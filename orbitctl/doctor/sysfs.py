"""Small readers for /sys and /proc: CPU lists, a GPU's PCIe device, a process's binding.

Every reader returns None (or an empty dict) when the file is missing or unreadable.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

# sysfs current_link_speed -> PCIe generation
_GT_TO_GEN = {"2.5": 1, "5.0": 2, "5": 2, "8.0": 3, "8": 3, "16.0": 4, "16": 4, "32.0": 5, "32": 5, "64.0": 6, "64": 6}


def parse_cpulist(text: str | None) -> list[int] | None:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; None for unparsable text."""
    if text is None:
        return None
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            start, end = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            return None
        if end - start > 1_000_000:
            return None
        cpus.extend(range(start, end + 1))
    return cpus


def format_cpulist(cpus: list[int] | None) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    if not cpus:
        return "-"
    cpus = sorted(set(cpus))
    runs, start, prev = [], cpus[0], cpus[0]
    for c in cpus[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(f"{start}-{prev}" if prev != start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(runs)


def cpus_of_mask(words: list[int]) -> list[int]:
    """NVML CPU affinity (64-bit words, lowest CPU first) -> CPU ids."""
    return [w * 64 + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]


def read_text(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def read_pci_device(bus_id: str, sysfs_root: str = "/sys") -> dict:
    """numa_node, local_cpulist and link speed/width of one PCIe device."""
    base = Path(sysfs_root) / "bus/pci/devices" / bus_id
    out: dict = {}
    numa = _int(read_text(base / "numa_node"))
    if numa is not None:
        out["numa_node"] = numa
    cpus = parse_cpulist(read_text(base / "local_cpulist"))
    if cpus is not None:
        out["local_cpulist"] = cpus
    for prefix in ("current", "max"):
        speed = read_text(base / f"{prefix}_link_speed")
        width = _int(read_text(base / f"{prefix}_link_width"))
        key = "cur" if prefix == "current" else "max"
        if speed:
            gen = _GT_TO_GEN.get(speed.split()[0])
            if gen:
                out[f"{key}_gen"] = gen
        if width:
            out[f"{key}_width"] = width
    return out


def read_process_binding(pid: int | str = "self") -> dict:
    """name, CPUs and memory nodes a process may use (from /proc/<pid>/status)."""
    text = read_text(f"/proc/{pid}/status")
    if text is None:
        return {}
    out: dict = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            out["name"] = value.strip()
        elif key == "Cpus_allowed_list":
            out["cpus"] = parse_cpulist(value)
        elif key == "Mems_allowed_list":
            out["mems"] = parse_cpulist(value)
    return out


def read_numa_nodes(sysfs_root: str = "/sys") -> dict[str, list[int]]:
    base = Path(sysfs_root) / "devices/system/node"
    nodes: dict[str, list[int]] = {}
    try:
        entries = sorted(p for p in base.iterdir() if p.name.startswith("node") and p.name[4:].isdigit())
    except OSError:
        return nodes
    for entry in entries:
        cpus = parse_cpulist(read_text(entry / "cpulist"))
        if cpus is not None:
            nodes[entry.name[4:]] = cpus
    return nodes


@lru_cache(maxsize=1)
def in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    cgroup = read_text("/proc/1/cgroup") or ""
    return any(word in cgroup for word in ("docker", "kubepods", "containerd", "lxc"))
