"""host.cpu: the CPU probe on fake /proc/cpuinfo files, and the check on recorded and mutated snapshots."""

from pathlib import Path

import pytest

from orbitctl.doctor import INFO, PASS, UNKNOWN, WARN, load_snapshot, run_checks
from orbitctl.doctor.probe_host import probe_cpu
from orbitctl.doctor.snapshot import Cpu
from orbitctl.profile import load_profile

FIX = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "profiles" / "tiny-cpu.yaml"

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC_7B13 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma sha_ni
"""


def _snap(name):
    return load_snapshot(FIX / "snapshots" / f"{name}.json")


def _cpu_finding(snap, profile=None):
    return next(f for f in run_checks(snap, profile=profile) if f.id == "host.cpu")


def test_probe_reads_model_and_isa_from_a_cpuinfo_file(tmp_path):
    (tmp_path / "cpuinfo").write_text(SAPPHIRE_RAPIDS)
    cpu = probe_cpu(str(tmp_path / "cpuinfo"))
    assert cpu.status == "ok" and cpu.model == "Intel(R) Xeon(R) Platinum 8480C"
    assert cpu.flags == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert probe_cpu(str(tmp_path / "missing")).status == "unreadable"


def test_native_bf16_host_passes_and_says_auto_is_bf16():
    finding = _cpu_finding(_snap("healthy_8xh100"))
    assert finding.status == PASS
    assert finding.data["native_bf16"] is True and finding.data["auto_dtype"] == "bf16"
    assert "Xeon(R) Platinum 8480C" in finding.evidence[0]
    assert "AMX-BF16 yes" in finding.evidence[1] and "torch AVX512" in finding.evidence[2]


def test_avx2_only_host_is_info_and_auto_is_fp32():
    finding = _cpu_finding(_snap("no_gpu"))
    assert finding.status == INFO and finding.fix is None
    assert finding.data["auto_dtype"] == "fp32"
    assert "AVX512-BF16 no" in finding.evidence[1]
    assert "compute in fp32" in finding.evidence[-1]


@pytest.mark.parametrize("env, capability, capped", [
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "AVX512", ["ONEDNN_MAX_CPU_ISA=AVX2"]),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2", ["ATEN_CPU_CAPABILITY=avx2"]),
])
def test_capped_kernels_are_not_native_and_the_fix_unsets_the_cap(env, capability, capped):
    snap = _snap("healthy_8xh100")
    snap.env.update(env)
    snap.torch.cpu_capability = capability
    finding = _cpu_finding(snap)
    assert finding.status == INFO and finding.data["capped_by"] == capped
    assert finding.data["auto_dtype"] == "fp32"
    assert finding.fix.startswith(f"unset {capped[0].split('=')[0]}")


def test_profile_that_forces_bf16_on_a_cpu_without_it_warns():
    snap = _snap("no_gpu")
    assert _cpu_finding(snap, load_profile(TINY)).status == INFO  # auto: fp32 here, nothing to warn about
    forced = _cpu_finding(snap, load_profile(TINY, ["quant.compute_dtype=bf16", "adapter.dtype=bf16"]))
    assert forced.status == WARN
    assert "quant.compute_dtype, adapter.dtype" in forced.evidence[-1] and "45x" in forced.evidence[-1]
    assert "--set quant.compute_dtype=auto --set adapter.dtype=auto" in forced.fix
    # on a CPU with native bf16 the same profile is fine, and a GPU profile never warns here
    assert _cpu_finding(_snap("healthy_8xh100"), load_profile(TINY, ["quant.compute_dtype=bf16"])).status == PASS
    gpu = load_profile(FIX / "profiles" / "llama8b_h100.yaml", ["quant.compute_dtype=bf16"])
    assert _cpu_finding(snap, gpu).status == INFO


def test_capped_host_and_forced_profile_offers_both_fixes():
    snap = _snap("healthy_8xh100")
    snap.env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    finding = _cpu_finding(snap, load_profile(TINY, ["adapter.dtype=bf16"]))
    assert finding.status == WARN
    assert finding.fix.startswith("unset ONEDNN_MAX_CPU_ISA, or set adapter.dtype to auto")


def test_without_torch_the_environment_decides():
    snap = _snap("healthy_8xh100")
    snap.torch.status, snap.torch.cpu_capability = "missing", None
    assert _cpu_finding(snap).status == PASS
    snap.env["ATEN_CPU_CAPABILITY"] = "avx2"
    finding = _cpu_finding(snap)
    assert finding.status == INFO and "torch not probed" in finding.evidence[2]


def test_no_cpu_data_is_unknown_never_pass():
    snap = _snap("healthy_8xh100")
    snap.host.cpu = Cpu()  # an older snapshot without the section
    assert _cpu_finding(snap).status == UNKNOWN
    snap.host.cpu = Cpu(status="unreadable", model="x86_64")
    finding = _cpu_finding(snap)
    assert finding.status == UNKNOWN and "could not be read" in finding.evidence[0]
