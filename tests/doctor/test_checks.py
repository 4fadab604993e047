"""Every recorded machine scenario gives exactly the failing checks it should, and nothing else breaks."""

from pathlib import Path

import pytest

from orbitctl.doctor import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, check_ids, load_snapshot, run_checks
from orbitctl.doctor.snapshot import GpuProcess

SNAPSHOTS = Path(__file__).parent / "fixtures" / "snapshots"

# scenario -> (FAIL ids, WARN ids)
SCENARIOS = {
    "healthy_8xh100": (set(), set()),
    "pcie_x8": ({"pcie.width"}, set()),
    "nvlink_down": ({"nvl.links", "xid.recent"}, set()),
    "wrong_numa": ({"numa.bind"}, {"gpu.busy"}),
    "ecc_uncorrected": ({"ecc.dbe", "xid.recent"}, {"ecc.remap"}),
    "throttling": ({"therm.temp", "therm.clk"}, set()),
    "foreign_40gb": ({"gpu.busy"}, {"numa.bind"}),
    "cpu_wheel": ({"env.torch"}, set()),
    "no_gpu": (set(), set()),
}
GPU_CHECKS = {"env.nvml", "ver.driver", "ver.arch", "ver.uniform", "gpu.count", "gpu.lost", "gpu.fabric", "gpu.busy",
              "gpu.persist", "ecc.dbe", "ecc.remap", "therm.temp", "therm.clk", "pcie.width", "pcie.gen", "pcie.replay",
              "nvl.links", "topo.p2p", "topo.acs", "numa.map", "numa.bind", "env.alloc"}


def statuses(findings):
    return {f.id: f.status for f in findings}


def test_at_least_29_checks_without_options_and_stable_ids():
    ids = check_ids(profile=False, active=False)
    assert len(ids) >= 29
    assert len(set(ids)) == len(ids)
    assert {"act.nccl", "act.dcgm", "prof.fit"} <= set(check_ids()) - set(ids)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_fails_exactly(name):
    fails, warns = SCENARIOS[name]
    found = statuses(run_checks(load_snapshot(SNAPSHOTS / f"{name}.json")))
    assert {k for k, v in found.items() if v == FAIL} == fails
    assert {k for k, v in found.items() if v == WARN} == warns
    healthy = statuses(run_checks(load_snapshot(SNAPSHOTS / "healthy_8xh100.json")))
    if name != "no_gpu":
        # every check that is not part of the scenario behaves exactly as on the healthy machine
        dependent = {"ver.driver", "ver.arch", "ver.nccl"} if name == "cpu_wheel" else set()
        for check_id, status in found.items():
            if check_id in dependent:  # nothing to compare without a CUDA build
                assert status == SKIP, check_id
            elif check_id not in fails | warns:
                assert status == healthy[check_id], check_id


def test_healthy_machine_passes_every_check():
    found = statuses(run_checks(load_snapshot(SNAPSHOTS / "healthy_8xh100.json")))
    assert set(found.values()) <= {PASS, INFO}
    assert {k for k, v in found.items() if v == INFO} == {"numa.map", "numa.bind", "host.isa"}  # host.isa: a table


def test_no_gpu_skips_gpu_checks_never_passes_them():
    found = statuses(run_checks(load_snapshot(SNAPSHOTS / "no_gpu.json")))
    for check_id in GPU_CHECKS:
        assert found[check_id] == SKIP, check_id
    assert found["xid.recent"] == UNKNOWN  # dmesg_restrict: could not see
    assert found["env.torch"] == SKIP


def test_no_gpu_with_expected_count_fails():
    found = statuses(run_checks(load_snapshot(SNAPSHOTS / "no_gpu.json"), expect_gpus=8))
    assert found["gpu.count"] == FAIL


def _healthy():
    return load_snapshot(SNAPSHOTS / "healthy_8xh100.json")


def test_evidence_names_the_bad_gpu_and_fix_is_concrete():
    found = {f.id: f for f in run_checks(load_snapshot(SNAPSHOTS / "pcie_x8.json"))}
    assert "GPU 5" in found["pcie.width"].evidence[0] and "x8 of x16" in found["pcie.width"].evidence[0]
    numa = {f.id: f for f in run_checks(load_snapshot(SNAPSHOTS / "wrong_numa.json"))}["numa.bind"]
    assert "numactl --cpunodebind=N --membind=N" in numa.fix
    assert len(numa.evidence) == 8


@pytest.mark.parametrize("mutate, check_id, status", [
    (lambda s: s.nvml.gpus[3].processes.append(GpuProcess(pid=999999, used_bytes=3 * 2**30, alive=False)), "gpu.busy", FAIL),
    (lambda s: s.nvml.gpus[3].processes.append(GpuProcess(pid=4242, used_bytes=300 * 2**20, alive=True)), "gpu.busy", WARN),
    (lambda s: setattr(s.nvml.gpus[0], "fabric_state", "in_progress"), "gpu.fabric", FAIL),
    (lambda s: setattr(s.nvml.pairs[5], "p2p_read", "CNS"), "topo.p2p", WARN),
    (lambda s: setattr(s.host, "cmdline", "ro intel_iommu=on"), "topo.acs", WARN),
    (lambda s: setattr(s.host.shm, "total_bytes", 64 * 2**20), "nccl.shm", FAIL),
    (lambda s: setattr(s.host.shm, "total_bytes", 400 * 2**20), "nccl.shm", WARN),
    (lambda s: setattr(s.master_port, "bindable", False), "net.port", FAIL),
    (lambda s: s.env.update(NCCL_ASYNC_ERROR_HANDLING="1"), "nccl.env", WARN),
    (lambda s: s.env.update(NCCL_P2P_DISABLE="1"), "nccl.env", WARN),
    (lambda s: s.env.update(NCCL_SOCKET_IFNAME="eth9"), "nccl.env", FAIL),
    (lambda s: setattr(s.nvml, "cuda_driver_version", 11080), "ver.driver", FAIL),
    (lambda s: setattr(s.nvml, "cuda_driver_version", 12020), "ver.driver", WARN),
    (lambda s: setattr(s.torch, "arch_list", ["sm_70", "sm_80"]), "ver.arch", FAIL),
    (lambda s: s.host.loaded_nccl.append("/usr/lib/x86_64-linux-gnu/libnccl.so.2.18.1"), "ver.nccl", WARN),
    (lambda s: setattr(s.nvml.gpus[7], "vbios", "96.00.61.00.01"), "ver.uniform", WARN),
    (lambda s: setattr(s.nvml.gpus[2], "lost", True), "gpu.lost", FAIL),
    (lambda s: setattr(s.nvml.gpus[2], "persistence_mode", False), "gpu.persist", WARN),
    (lambda s: setattr(s.nvml.gpus[2].pcie, "replay_counter_later", 12), "pcie.replay", WARN),
    (lambda s: setattr(s.nvml.gpus[2].pcie, "cur_gen", 1), "pcie.gen", INFO),
    (lambda s: setattr(s.nvml.gpus[4], "clock_event_reasons", 0x4) or setattr(s.nvml.gpus[4], "utilization_pct", 95),
     "therm.clk", WARN),
    (lambda s: setattr(s.kernel_log, "xid_lines", ["NVRM: Xid (PCI:0000:18:00): 13, pid=1, Graphics Exception"]),
     "xid.recent", INFO),
    (lambda s: setattr(s.kernel_log, "xid_lines", ["NVRM: Xid (PCI:0000:18:00): 94, pid=1, Contained ECC error"]),
     "xid.recent", WARN),
    (lambda s: setattr(s.kernel_log, "xid_lines", ["NVRM: Xid (PCI:0000:dc:00): 149, NETIR_LINK_EVT Fatal error"]),
     "xid.recent", FAIL),
    (lambda s: s.env.pop("PYTORCH_CUDA_ALLOC_CONF"), "env.alloc", INFO),
    (lambda s: setattr(s.torch, "device_count", 7), "gpu.count", FAIL),
    (lambda s: setattr(s.host, "stale_build_locks", ["/root/.cache/torch_extensions/py311_cpu/deepspeed_shm_comm/lock"]),
     "env.build_locks", WARN),
])
def test_single_fault(mutate, check_id, status):
    snap = _healthy()
    mutate(snap)
    found = statuses(run_checks(snap))
    assert found[check_id] == status
    others = {k: v for k, v in found.items() if k != check_id and v in (FAIL, WARN)}
    assert others == {}


def test_permission_denied_is_unknown_never_pass():
    snap = _healthy()
    for g in snap.nvml.gpus:
        g.ecc_volatile_uncorrected = g.ecc_aggregate_uncorrected = None
        g.errors["ecc.volatile"] = "no_permission"
    assert statuses(run_checks(snap))["ecc.dbe"] == UNKNOWN
    snap.nvml.status, snap.nvml.gpus = "no_permission", []
    found = statuses(run_checks(snap))
    assert found["env.nvml"] == UNKNOWN and found["pcie.width"] == UNKNOWN


def test_not_supported_field_is_skip():
    snap = _healthy()
    for g in snap.nvml.gpus:
        g.remapped_rows = None
        g.errors["remapped_rows"] = "not_supported"
    assert statuses(run_checks(snap))["ecc.remap"] == SKIP


def test_no_gpu_machine_warns_instead_of_failing_on_nccl_settings():
    snap = load_snapshot(SNAPSHOTS / "no_gpu.json")
    snap.master_port.bindable = False
    snap.env["NCCL_SOCKET_IFNAME"] = "eth9"
    found = statuses(run_checks(snap))
    assert found["net.port"] == WARN and found["nccl.env"] == WARN


def test_one_gpu_skips_the_pair_checks_with_their_own_line():
    snap = _healthy()
    snap.nvml.gpus, snap.nvml.pairs = snap.nvml.gpus[:1], []
    found = {f.id: f for f in run_checks(snap)}
    assert (found["topo.p2p"].status, found["topo.p2p"].evidence) == (SKIP, ["one GPU: no pairs"])
    assert (found["topo.acs"].status, found["topo.acs"].evidence) == (SKIP, ["one GPU: no P2P path"])
    assert found["pcie.width"].status == PASS  # one GPU is enough for the other GPU checks


def test_the_registry_answers_for_every_gpu_check_without_gpus():
    from orbitctl.doctor.registry import REGISTRY, no_gpu_outcome

    snap = load_snapshot(SNAPSHOTS / "no_gpu.json")
    expected = no_gpu_outcome(snap)
    found = {f.id: f for f in run_checks(snap)}
    guarded = [c.id for c in REGISTRY if c.min_gpus and c.when == "always"]
    assert len(guarded) >= 20
    for check_id in guarded:
        assert (found[check_id].status, found[check_id].evidence, found[check_id].fix) == \
            (expected.status, expected.evidence, expected.fix), check_id


def test_a_finding_needs_a_known_area_and_reports_show_areas_log_first():
    from orbitctl.doctor import Finding, Report
    from orbitctl.doctor.findings import AREAS

    with pytest.raises(ValueError, match="unknown area"):
        Finding("x.y", "network", PASS, "title")
    report = Report(findings=[Finding(f"{area}.x", area, PASS, "t") for area in reversed(AREAS)])
    assert [area for area, _ in report.by_area()] == list(AREAS) and AREAS[0] == "log"
    report.findings[0].area = "elsewhere"  # changed after construction: shown last, never dropped
    assert report.by_area()[-1] == ("elsewhere", [report.findings[0]])
