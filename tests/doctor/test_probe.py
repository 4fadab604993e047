"""Probes: NVML error mapping through a stand-in NVML module (no GPU here), the live host probes, snapshot files."""

import json
import socket
from types import SimpleNamespace

import pytest

from orbitctl.doctor import FAIL, SKIP, UNKNOWN, load_snapshot, run_checks, save_snapshot, take_snapshot
from orbitctl.doctor.probe_host import probe_env, probe_master_port, probe_shm
from orbitctl.doctor.probe_nvml import NvmlProbe, nvml_error_kind, sysfs_bus_id
from orbitctl.doctor.sysfs import cpus_of_mask, format_cpulist, parse_cpulist
from orbitctl.errors import InputFileError


class NVMLError(Exception):
    pass


def _err(name):
    return type(f"NVMLError_{name}", (NVMLError,), {})


NotSupported, NoPermission, GPUIsLost, LibraryNotFound, InvalidArgument = (
    _err("NotSupported"), _err("NoPermission"), _err("GPUIsLost"), _err("LibraryNotFound"), _err("InvalidArgument"))


class FakeNvml:
    """pynvml's names for two H100s: GPU 1 is lost half-way, ECC needs root, NVLink has 2 links."""

    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_P2P_CAPS_INDEX_READ, NVML_P2P_CAPS_INDEX_NVLINK = 0, 2
    NVML_NVLINK_MAX_LINKS = 36

    def __init__(self, init_error=None):
        self.init_error = init_error
        self.shutdown_called = False

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=b"00000000:18:00.0" if h == 0 else "00000000:2A:00.0")

    def nvmlDeviceGetVbiosVersion(self, h):
        return "96.00.74.00.01"

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetMemoryInfo(self, h):
        if h == 1:
            raise GPUIsLost()
        return SimpleNamespace(total=80 * 2**30, used=2**29, free=80 * 2**30 - 2**29)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=2**22 + 7, usedGpuMemory=3 * 2**30)] if h == 0 else []

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    nvmlDeviceGetMaxPcieLinkGeneration = nvmlDeviceGetCurrPcieLinkGeneration

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 16

    nvmlDeviceGetMaxPcieLinkWidth = nvmlDeviceGetCurrPcieLinkWidth

    def nvmlDeviceGetPcieReplayCounter(self, h):
        raise NotSupported()

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 2:
            raise InvalidArgument()
        return 1

    def nvmlDeviceGetTemperature(self, h, kind):
        return 40

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        return 90

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 1

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        raise NoPermission()

    def nvmlDeviceGetRemappedRows(self, h):
        return (0, 0, 0, 0)

    def nvmlDeviceGetPersistenceMode(self, h):
        return 1

    def nvmlDeviceGetGpuFabricInfoV(self, h, ref):
        raise NotSupported()

    def nvmlDeviceGetCpuAffinity(self, h, words):
        return [0xF] + [0] * (words - 1)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 40

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        return 0


def test_fake_nvml_maps_errors_to_fields():
    fake = FakeNvml()
    nv = NvmlProbe(fake, replay_interval_s=0).probe()
    assert nv.status == "ok" and fake.shutdown_called
    g0, g1 = nv.gpus
    assert g0.bus_id == "0000:18:00.0" and g1.bus_id == "0000:2a:00.0"
    assert g0.nvlink_active == [True, True]
    assert g0.cpu_affinity == [0, 1, 2, 3]
    assert g0.errors["ecc.volatile"] == "no_permission" and g0.errors["pcie.replay"] == "not_supported"
    assert g1.lost and g1.memory_total_bytes is None
    assert g0.processes[0].alive in (False, None)  # a PID that does not exist here
    assert nv.pairs[0].common_ancestor == "node" and nv.pairs[0].p2p_read == "OK"
    snap = take_snapshot(NvmlProbe(fake, replay_interval_s=0), probe_torch=False)
    found = {f.id: f.status for f in run_checks(snap)}
    assert found["gpu.lost"] == FAIL
    assert found["ecc.dbe"] == UNKNOWN      # no permission: could not see
    assert found["pcie.replay"] == SKIP     # not supported on these GPUs
    assert found["gpu.fabric"] == SKIP


@pytest.mark.parametrize("error, status", [(LibraryNotFound, "no_library"), (_err("DriverNotLoaded"), "no_driver"),
                                           (NoPermission, "no_permission"), (_err("Unknown"), "error")])
def test_nvml_init_failures_never_raise(error, status):
    nv = NvmlProbe(FakeNvml(init_error=error)).probe()
    assert nv.status == status and nv.gpus == []


def test_live_probe_on_this_machine_sees_no_gpu_and_saves(tmp_path):
    snap = take_snapshot()
    assert snap.nvml.status in ("no_library", "no_driver")
    assert snap.torch.status == "ok" and snap.torch.version.startswith("2.")
    assert snap.host.cpu_count and snap.host.process.cpus_allowed
    path = save_snapshot(snap, tmp_path / "node.json")
    again = load_snapshot(path)
    assert again.model_dump() == snap.model_dump()
    assert not list(tmp_path.glob(".node.json.*"))  # no temp file left behind


def test_bad_snapshot_files(tmp_path):
    with pytest.raises(InputFileError, match="not found"):
        load_snapshot(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputFileError, match="not a JSON snapshot"):
        load_snapshot(bad)
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(InputFileError, match="format"):
        load_snapshot(bad)
    bad.write_text(json.dumps({"format": "orbitctl.doctor.snapshot/1", "nvml": {"gpus": [{"index": "zero"}]}}))
    with pytest.raises(InputFileError, match="nvml.gpus.0.index"):
        load_snapshot(bad)


def test_master_port_in_use_is_seen():
    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        taken = probe_master_port({"MASTER_PORT": str(port)})
        assert taken.bindable is False and "98" in taken.error
    finally:
        sock.close()
    assert probe_master_port({"MASTER_PORT": "abc"}).bindable is None


def test_small_helpers():
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert cpus_of_mask([0b101, 1]) == [0, 2, 64]
    assert sysfs_bus_id("00000000:AB:00.0") == "0000:ab:00.0"
    assert nvml_error_kind(NoPermission()) == "no_permission"
    assert probe_env({"NCCL_DEBUG": "INFO", "HOME": "/root", "MASTER_PORT": "1"}) == {"MASTER_PORT": "1", "NCCL_DEBUG": "INFO"}
    assert probe_shm("/nonexistent-shm").status == "missing"
