"""The Snapshot: every live probe result of one machine, as one JSON document.

`orbitctl doctor --save-snapshot FILE` writes it, `--snapshot FILE` runs the checks on it.
A field that is ``None`` means "not seen": the probe was not applicable, not supported or
not permitted; ``errors`` on a GPU says which. The format is documented in docs/doctor.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orbitctl.errors import InputFileError
from orbitctl.rundir import atomic_write_json

FORMAT = "orbitctl.doctor.snapshot/1"


class Part(BaseModel):
    # Unknown keys are ignored so a newer snapshot still loads in an older doctor.
    model_config = ConfigDict(extra="ignore")


class GpuProcess(Part):
    pid: int
    used_bytes: int | None = None
    name: str | None = None
    alive: bool | None = None
    """The PID exists in this PID namespace; False = a dead process still holding memory."""
    own: bool = False
    """The doctor itself, its parent or its children (not foreign)."""
    cpus_allowed: list[int] | None = None
    """The process's CPU binding (Cpus_allowed_list), when readable: where this rank runs."""
    mems_allowed: list[int] | None = None


class Pcie(Part):
    cur_gen: int | None = None
    max_gen: int | None = None
    cur_width: int | None = None
    max_width: int | None = None
    replay_counter: int | None = None
    replay_counter_later: int | None = None
    """The replay counter sampled again about a second later (rising = link errors now)."""


class RemappedRows(Part):
    correctable: int = 0
    uncorrectable: int = 0
    pending: bool = False
    failure: bool = False


class Gpu(Part):
    index: int
    name: str | None = None
    uuid: str | None = None
    bus_id: str | None = None
    """sysfs form: 0000:18:00.0 (4-digit domain, lowercase)."""
    vbios: str | None = None
    compute_capability: list[int] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_pct: int | None = None
    processes: list[GpuProcess] | None = None
    pcie: Pcie = Field(default_factory=Pcie)
    nvlink_active: list[bool] | None = None
    """State of every NVLink link; None = no NVLink (or not supported)."""
    temperature_c: int | None = None
    slowdown_c: int | None = None
    clock_event_reasons: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    remapped_rows: RemappedRows | None = None
    persistence_mode: bool | None = None
    fabric_state: str | None = None
    """completed | in_progress | not_started | not_supported (no NVSwitch fabric)."""
    fabric_status: str | None = None
    numa_node: int | None = None
    """sysfs numa_node; -1 = the platform gives no NUMA information."""
    local_cpulist: list[int] | None = None
    cpu_affinity: list[int] | None = None
    lost: bool = False
    """NVML said GPU_IS_LOST: the GPU fell off the bus."""
    errors: dict[str, str] = Field(default_factory=dict)
    """Field -> why it is None: not_supported, no_permission or an error text."""


class GpuPair(Part):
    a: int
    b: int
    common_ancestor: str | None = None
    """internal | single | multiple | hostbridge | node | system (PCIe path; ignores NVLink)."""
    p2p_read: str | None = None
    """OK | CNS | GNS | TNS | NS | DR | UNKNOWN (nvidia-smi topo -p2p r legend)."""
    p2p_nvlink: str | None = None


class Nvml(Part):
    status: Literal["ok", "no_library", "no_driver", "no_permission", "error"] = "ok"
    detail: str | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    """NVML's CUDA driver version as an integer, e.g. 12080 = 12.8."""
    gpus: list[Gpu] = Field(default_factory=list)
    pairs: list[GpuPair] = Field(default_factory=list)


class TorchInfo(Part):
    status: Literal["ok", "missing", "error"] = "missing"
    detail: str | None = None
    version: str | None = None
    cuda: str | None = None
    """torch.version.cuda: None for a CPU-only wheel."""
    hip: str | None = None
    cuda_available: bool | None = None
    device_count: int | None = None
    arch_list: list[str] = Field(default_factory=list)
    capabilities: list[list[int]] = Field(default_factory=list)
    nccl_version: str | None = None
    cpu_capability: str | None = None
    """torch.backends.cpu.get_cpu_capability(): the CPU kernels torch picks (AVX512, AVX2, ...; honours ATEN_CPU_CAPABILITY)."""


class XState(Part):
    """What the kernel says about the CPU's register state, asked with arch_prctl in a child process."""

    status: Literal["ok", "unsupported", "error", "missing"] = "missing"
    """ok: the child asked the kernel; unsupported: not x86-64 Linux; error: the child failed; missing: not probed."""
    detail: str | None = None
    xcr0: int | None = None
    """ARCH_GET_XCOMP_SUPP: the user state components the kernel enabled in XCR0 (None: not answered)."""
    xcr0_errno: int | None = None
    """errno of ARCH_GET_XCOMP_SUPP (EINVAL: a kernel before 5.16, which has no such call)."""
    amx_request_errno: int | None = None
    """ARCH_REQ_XCOMP_PERM(XFEATURE_XTILEDATA) in the child: 0 granted, else its errno; None: not asked."""
    amx_permitted: bool | None = None
    """ARCH_GET_XCOMP_PERM read back after the request has XTILEDATA (bit 18); None: not answered."""


class Isa(Part):
    """The ISA features of the `isa` table (orbitctl.doctor.isa) and the OS state behind them."""

    status: Literal["ok", "unreadable", "not_x86", "missing"] = "missing"
    flags: list[str] = Field(default_factory=list)
    """The features of orbitctl.doctor.isa.ISA_FEATURES that /proc/cpuinfo lists."""
    xstate: XState = Field(default_factory=XState)


class Cpu(Part):
    status: Literal["ok", "unreadable", "missing"] = "missing"
    """ok: /proc/cpuinfo was read; unreadable: it could not be; missing: not probed (an older snapshot)."""
    model: str | None = None
    arch: str | None = None
    flags: list[str] = Field(default_factory=list)
    """The ISA flags the checks look at that this CPU has: avx2, avx512f, avx512_bf16, amx_tile, amx_bf16."""
    isa: Isa = Field(default_factory=Isa)
    """Every ISA feature of the `isa` table with the OS state of its registers (status missing: an older snapshot)."""


class Shm(Part):
    status: Literal["ok", "missing", "error"] = "ok"
    total_bytes: int | None = None
    free_bytes: int | None = None


class ProcessBinding(Part):
    pid: int | None = None
    cpus_allowed: list[int] | None = None
    mems_allowed: list[int] | None = None


class Host(Part):
    hostname: str | None = None
    kernel: str | None = None
    cpu_count: int | None = None
    numa_nodes: dict[str, list[int]] = Field(default_factory=dict)
    """NUMA node id -> its CPUs (from /sys/devices/system/node)."""
    process: ProcessBinding = Field(default_factory=ProcessBinding)
    shm: Shm = Field(default_factory=Shm)
    cmdline: str | None = None
    net_interfaces: list[str] | None = None
    loaded_nccl: list[str] | None = None
    """libnccl files mapped into this process (/proc/self/maps)."""
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    acs_enabled_bridges: list[str] | None = None
    """PCI bridges with ACS source validation on (lspci -vvv, root only); None = not seen."""
    cpu: Cpu = Field(default_factory=Cpu)
    """The CPU model and ISA flags (/proc/cpuinfo)."""
    stale_build_locks: list[str] | None = None
    """Op-build lock files that no process holds (orbitctl.dist.build_locks): each makes the next DeepSpeed op build,
    and so the next train, wait forever; None = not looked."""


class KernelLog(Part):
    status: Literal["ok", "unreadable", "missing"] = "missing"
    source: str | None = None
    detail: str | None = None
    xid_lines: list[str] = Field(default_factory=list)


class MasterPort(Part):
    port: int | None = None
    bindable: bool | None = None
    error: str | None = None


class Snapshot(Part):
    """One machine's state: GPUs (NVML), torch build, host, environment, kernel log."""

    format: str = FORMAT
    taken_at: str | None = None
    nvml: Nvml = Field(default_factory=Nvml)
    torch: TorchInfo = Field(default_factory=TorchInfo)
    host: Host = Field(default_factory=Host)
    env: dict[str, str] = Field(default_factory=dict)
    kernel_log: KernelLog = Field(default_factory=KernelLog)
    master_port: MasterPort = Field(default_factory=MasterPort)
    active: dict[str, Any] = Field(default_factory=dict)
    """Results of the opt-in active tests (--active): act.nccl, act.dcgm."""

    @property
    def has_gpus(self) -> bool:
        return self.nvml.status == "ok" and bool(self.nvml.gpus)


def load_snapshot(path: str | Path) -> Snapshot:
    """Read a saved snapshot; a missing or malformed file is an InputFileError (exit 2)."""
    file = Path(path)
    if not file.is_file():
        raise InputFileError(f"{path}: snapshot file not found", fix="Write one with `orbitctl doctor --save-snapshot FILE`")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputFileError(f"{path}: not a JSON snapshot ({exc})",
                             fix="Write one with `orbitctl doctor --save-snapshot FILE`") from exc
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("orbitctl.doctor.snapshot/"):
        raise InputFileError(f"{path}: format: expected '{FORMAT}'",
                             fix="Write one with `orbitctl doctor --save-snapshot FILE`")
    try:
        return Snapshot.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise InputFileError(f"{path}: {key}: {err['msg']}",
                             fix="Fix that key or write a fresh one with `orbitctl doctor --save-snapshot FILE`") from exc


def save_snapshot(snapshot: Snapshot, path: str | Path) -> Path:
    """Write the snapshot atomically (temp file, then rename): never a half-written file."""
    return atomic_write_json(path, snapshot.model_dump(mode="json"), fsync=False)
