"""GPU probes through NVML (`import pynvml`, from the nvidia-ml-py package).

The doctor talks to GPUs only through the small :class:`GpuProbe` interface, so tests feed
recorded snapshots and a fake NVML module instead of hardware. NVML errors map to results:
library or driver missing -> status no_library/no_driver (GPU checks SKIP); NotSupported ->
that field is None with errors[field] = "not_supported"; NoPermission -> "no_permission"
(the check says UNKNOWN); GPUIsLost -> Gpu.lost (FAIL). Nothing here raises.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Protocol

from orbitctl.doctor.snapshot import Gpu, GpuPair, GpuProcess, Nvml, Pcie, RemappedRows
from orbitctl.doctor.sysfs import cpus_of_mask, read_pci_device

TOPOLOGY = {0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"}
P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "UNKNOWN"}
FABRIC_STATE = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}


class GpuProbe(Protocol):
    """Anything that can describe the machine's GPUs as an :class:`Nvml` section."""

    def probe(self) -> Nvml: ...


def nvml_error_kind(exc: BaseException) -> str:
    """Classify an NVML exception by its class name (pynvml builds the classes at import)."""
    name = type(exc).__name__
    for needle, kind in (
        ("LibraryNotFound", "no_library"), ("DriverNotLoaded", "no_driver"), ("NoPermission", "no_permission"),
        ("NotSupported", "not_supported"), ("FunctionNotFound", "not_supported"), ("GPUIsLost", "gpu_lost"),
        ("InvalidArgument", "invalid_argument"), ("NotFound", "not_found"),
    ):
        if needle in name:
            return kind
    return f"error: {exc}"[:200]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's 00000000:18:00.0 -> sysfs's 0000:18:00.0 (4-digit domain, lowercase)."""
    text = nvml_bus_id.strip().lower()
    domain, _, rest = text.partition(":")
    return f"{domain[-4:]}:{rest}" if rest else text


class NvmlProbe:
    """Live NVML probe; ``nvml`` may be a stand-in module with pynvml's names (tests)."""

    def __init__(self, nvml: Any = None, sysfs_root: str = "/sys", replay_interval_s: float = 1.0) -> None:
        self._nvml = nvml
        self.sysfs_root = sysfs_root
        self.replay_interval_s = replay_interval_s

    def probe(self) -> Nvml:
        nv = self._nvml
        if nv is None:
            try:
                import pynvml as nv  # noqa: PLC0415 - heavy import kept out of module import
            except Exception as exc:  # ImportError or a broken install
                return Nvml(status="no_library", detail=f"nvidia-ml-py not importable: {exc}")
        try:
            nv.nvmlInit()
        except Exception as exc:
            kind = nvml_error_kind(exc)
            status = kind if kind in ("no_library", "no_driver", "no_permission") else "error"
            return Nvml(status=status, detail=f"nvmlInit failed: {exc}")
        try:
            return self._probe_initialised(nv)
        except Exception as exc:  # never let one odd driver crash the doctor
            return Nvml(status="error", detail=f"NVML probe failed: {exc}")
        finally:
            try:
                nv.nvmlShutdown()
            except Exception:
                pass

    def _probe_initialised(self, nv: Any) -> Nvml:
        out = Nvml(status="ok")
        out.driver_version = _call(lambda: _text(nv.nvmlSystemGetDriverVersion()))[0]
        out.cuda_driver_version = _call(nv.nvmlSystemGetCudaDriverVersion)[0]
        count, err = _call(nv.nvmlDeviceGetCount)
        if count is None:
            out.status, out.detail = ("no_permission" if err == "no_permission" else "error"), f"nvmlDeviceGetCount: {err}"
            return out
        handles = []
        for index in range(count):
            handle, err = _call(lambda: nv.nvmlDeviceGetHandleByIndex(index))
            if handle is None:
                out.gpus.append(Gpu(index=index, lost=err == "gpu_lost", errors={"handle": err or "error"}))
                continue
            handles.append((index, handle))
            out.gpus.append(self._probe_gpu(nv, index, handle))
        self._sample_replay_again(nv, out, handles)
        out.pairs = self._probe_pairs(nv, handles)
        return out

    def _probe_gpu(self, nv: Any, index: int, h: Any) -> Gpu:
        gpu = Gpu(index=index)

        def field(name: str, fn: Callable[[], Any]) -> Any:
            value, err = _call(fn)
            if err:
                gpu.errors[name] = err
                if err == "gpu_lost":
                    gpu.lost = True
            return value

        gpu.name = field("name", lambda: _text(nv.nvmlDeviceGetName(h)))
        gpu.uuid = field("uuid", lambda: _text(nv.nvmlDeviceGetUUID(h)))
        bus = field("bus_id", lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId))
        gpu.bus_id = sysfs_bus_id(bus) if bus else None
        gpu.vbios = field("vbios", lambda: _text(nv.nvmlDeviceGetVbiosVersion(h)))
        cc = field("compute_capability", lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
        gpu.compute_capability = list(cc) if cc else None
        mem = field("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            gpu.memory_total_bytes, gpu.memory_used_bytes, gpu.memory_free_bytes = int(mem.total), int(mem.used), int(mem.free)
        util = field("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        gpu.utilization_pct = int(util.gpu) if util is not None else None
        procs = field("processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))
        gpu.processes = [describe_process(p) for p in procs] if procs is not None else None
        gpu.pcie = Pcie(
            cur_gen=field("pcie.cur_gen", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            max_gen=field("pcie.max_gen", lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            cur_width=field("pcie.cur_width", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
            max_width=field("pcie.max_width", lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
            replay_counter=field("pcie.replay", lambda: nv.nvmlDeviceGetPcieReplayCounter(h)),
        )
        gpu.nvlink_active = self._nvlink_states(nv, h)
        gpu.temperature_c = field("temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        gpu.slowdown_c = field("slowdown", lambda: nv.nvmlDeviceGetTemperatureThreshold(
            h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        gpu.clock_event_reasons = field("clock_event_reasons", lambda: _clock_reasons(nv, h))
        gpu.ecc_volatile_uncorrected = field("ecc.volatile", lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        gpu.ecc_aggregate_uncorrected = field("ecc.aggregate", lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC))
        rows = field("remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, pending, failure = rows
            gpu.remapped_rows = RemappedRows(correctable=corr, uncorrectable=unc, pending=bool(pending), failure=bool(failure))
        mode = field("persistence_mode", lambda: nv.nvmlDeviceGetPersistenceMode(h))
        gpu.persistence_mode = bool(mode) if mode is not None else None
        fabric = field("fabric", lambda: _fabric(nv, h))
        if fabric is not None:
            gpu.fabric_state, gpu.fabric_status = fabric
        words = max(1, ((os.cpu_count() or 64) + 63) // 64)
        mask = field("cpu_affinity", lambda: list(nv.nvmlDeviceGetCpuAffinity(h, words)))
        gpu.cpu_affinity = cpus_of_mask(mask) if mask is not None else None
        if gpu.bus_id:
            pci = read_pci_device(gpu.bus_id, self.sysfs_root)
            gpu.numa_node = pci.get("numa_node")
            gpu.local_cpulist = pci.get("local_cpulist")
            # sysfs fills in the link when NVML does not report it
            for key in ("cur_gen", "max_gen", "cur_width", "max_width"):
                if getattr(gpu.pcie, key) is None and pci.get(key) is not None:
                    setattr(gpu.pcie, key, pci[key])
        return gpu

    def _nvlink_states(self, nv: Any, h: Any) -> list[bool] | None:
        states: list[bool] = []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 36)):
            value, err = _call(lambda: nv.nvmlDeviceGetNvLinkState(h, link))
            if err:  # NotSupported or InvalidArgument past the last link
                break
            states.append(bool(value))
        return states or None

    def _sample_replay_again(self, nv: Any, out: Nvml, handles: list) -> None:
        if not handles or all(g.pcie.replay_counter is None for g in out.gpus):
            return
        time.sleep(self.replay_interval_s)
        by_index = {g.index: g for g in out.gpus}
        for index, h in handles:
            value, _ = _call(lambda: nv.nvmlDeviceGetPcieReplayCounter(h))
            by_index[index].pcie.replay_counter_later = value

    def _probe_pairs(self, nv: Any, handles: list) -> list[GpuPair]:
        pairs = []
        for i, (a, ha) in enumerate(handles):
            for b, hb in handles[i + 1:]:
                anc, _ = _call(lambda: nv.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
                read, _ = _call(lambda: nv.nvmlDeviceGetP2PStatus(ha, hb, nv.NVML_P2P_CAPS_INDEX_READ))
                link, _ = _call(lambda: nv.nvmlDeviceGetP2PStatus(ha, hb, nv.NVML_P2P_CAPS_INDEX_NVLINK))
                pairs.append(GpuPair(a=a, b=b, common_ancestor=TOPOLOGY.get(anc) if anc is not None else None,
                                     p2p_read=P2P_STATUS.get(read) if read is not None else None,
                                     p2p_nvlink=P2P_STATUS.get(link) if link is not None else None))
        return pairs


def _call(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run one NVML call; (value, None) or (None, error kind)."""
    try:
        return fn(), None
    except Exception as exc:
        return None, nvml_error_kind(exc)


def _clock_reasons(nv: Any, h: Any) -> int:
    getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    try:
        return int(getter(h))
    except Exception as exc:
        if nvml_error_kind(exc) == "not_supported" and hasattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons"):
            return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        raise


def _fabric(nv: Any, h: Any) -> tuple[str, str]:
    import ctypes

    info = nv.c_nvmlGpuFabricInfoV_t()
    nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    return FABRIC_STATE.get(int(info.state), str(info.state)), str(int(info.status))


def describe_process(proc: Any) -> GpuProcess:
    """An NVML process entry plus what /proc says about it (alive, name, CPU binding)."""
    from orbitctl.doctor.sysfs import read_process_binding

    pid = int(proc.pid)
    used = getattr(proc, "usedGpuMemory", None)
    from orbitctl.doctor.sysfs import in_container

    visible = os.path.exists(f"/proc/{pid}")
    # In a container NVML may report host PIDs we cannot see: unknown, not dead.
    alive: bool | None = True if visible else (None if in_container() else False)
    binding = read_process_binding(pid) if visible else {}
    own = pid in (os.getpid(), os.getppid())
    return GpuProcess(pid=pid, used_bytes=int(used) if isinstance(used, int) else None, alive=alive, own=own,
                      name=binding.get("name"), cpus_allowed=binding.get("cpus"), mems_allowed=binding.get("mems"))
