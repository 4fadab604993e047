"""dtype auto: the rule on fake CPUs (pure functions), and on this host under an env cap (subprocess)."""

import os
import subprocess
import sys

import pytest

from orbitctl.errors import UserError
from orbitctl.kernels.cpu_dtype import (BF16_FLAGS, CAP_ENV, bf16_verdict, device_type, onednn_cap, parse_cpuinfo,
                                      read_host_cpu, resolve_dtype)

AVX2_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma"})
ZEN4 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}

CPUINFO_X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512_bf16
"""
CPUINFO_ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fixed_dtypes_stay_as_they_are(name, device):
    assert resolve_dtype(name, device, cpu_native_bf16=False) == name
    assert resolve_dtype(name, device, cpu_native_bf16=True) == name


def test_auto_is_bf16_on_cuda_and_follows_the_cpu_on_the_cpu():
    assert resolve_dtype("auto", "cuda", cpu_native_bf16=False) == "bf16"
    assert resolve_dtype("auto", "cpu", cpu_native_bf16=True) == "bf16"
    assert resolve_dtype("auto", "cpu", cpu_native_bf16=False) == "fp32"


def test_unknown_dtype_is_bad_input():
    with pytest.raises(UserError, match="unknown value 'int8'"):
        resolve_dtype("int8", "cpu", cpu_native_bf16=True)


@pytest.mark.parametrize("flags, capability, env, native, capped", [
    (AVX2_EPYC, "AVX2", {}, False, ()),                                     # the measured 45x case
    (ZEN4, "AVX512", {}, True, ()),
    (SAPPHIRE_RAPIDS, "AVX512", {}, True, ()),
    (ZEN4, "AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}, False, ("ATEN_CPU_CAPABILITY=avx2",)),
    (ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, ("ONEDNN_MAX_CPU_ISA=AVX2",)),
    (ZEN4, "AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, False,
     ("ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2")),
    (ZEN4, "AVX512", {"DNNL_MAX_CPU_ISA": "avx512_core"}, False, ("DNNL_MAX_CPU_ISA=avx512_core",)),
    (ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, ()),
    (ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "ALL"}, True, ()),
    (SAPPHIRE_RAPIDS, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True, ()),
    (ZEN4, "DEFAULT", {}, False, ("torch kernel capability DEFAULT",)),     # a torch build without AVX512 kernels
    (ZEN4, None, {}, True, ()),                                             # torch not asked: the env decides
    (ZEN4, None, {"ATEN_CPU_CAPABILITY": "avx2"}, False, ("ATEN_CPU_CAPABILITY=avx2",)),
    (frozenset({"fp", "asimd", "bf16"}), "SVE256", {}, False, ()),         # Arm: outside the x86 rule
])
def test_native_bf16_needs_the_flag_and_no_cap(flags, capability, env, native, capped):
    verdict = bf16_verdict(flags, capability, env)
    assert verdict.native is native, verdict.reason
    assert verdict.capped_by == capped
    assert resolve_dtype("auto", "cpu", cpu_native_bf16=verdict.native) == ("bf16" if native else "fp32")


def test_verdict_reasons_say_why():
    assert "neither AVX512-BF16 nor AMX-BF16" in bf16_verdict(AVX2_EPYC, "AVX2", {}).reason
    capped = bf16_verdict(ZEN4, "AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}).reason
    assert "AVX512-BF16" in capped and "ATEN_CPU_CAPABILITY=avx2" in capped


def test_onednn_cap_reads_both_names():
    assert onednn_cap({}) is None and onednn_cap({"ONEDNN_MAX_CPU_ISA": "ALL"}) is None
    assert onednn_cap({"DNNL_MAX_CPU_ISA": "AVX2"}) == "avx2"
    assert onednn_cap({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16", "DNNL_MAX_CPU_ISA": "AVX2"}) == "avx512_core_bf16"


def test_parse_cpuinfo_x86_and_arm():
    x86 = parse_cpuinfo(CPUINFO_X86, "x86_64")
    assert x86.model == "AMD EPYC 9R14 96-Core Processor"
    assert x86.isa() == ["avx2", "avx512f", "avx512_bf16"]
    arm = parse_cpuinfo(CPUINFO_ARM, "aarch64")
    assert arm.model is None and "bf16" in arm.flags and arm.isa() == []
    assert parse_cpuinfo("").flags == frozenset()


def test_device_type():
    assert device_type("cpu") == "cpu" and device_type("cuda:3") == "cuda"


def test_planned_dtype_needs_no_torch():
    code = ("import sys; from orbitctl.kernels.cpu_dtype import planned_dtype; "
            "print(planned_dtype('auto', 'cpu', {'ONEDNN_MAX_CPU_ISA': 'AVX2'}), planned_dtype('auto', 'cuda'), "
            "planned_dtype('fp32', 'cuda'), 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["fp32", "bf16", "fp32", "False"], proc.stderr


def test_unreadable_cpuinfo_is_none(tmp_path):
    assert read_host_cpu(str(tmp_path / "missing")) is None


_RESOLVE = ("import torch; from orbitctl.kernels.cpu_dtype import resolved_dtype; "
            "print(resolved_dtype('auto', 'cpu'), resolved_dtype('auto', 'cuda:0'), resolved_dtype('bf16', 'cpu'), "
            "torch.backends.cpu.get_cpu_capability())")


def _resolve_in_child(**env):
    pytest.importorskip("torch")
    clean = {k: v for k, v in os.environ.items() if k not in CAP_ENV}
    proc = subprocess.run([sys.executable, "-c", _RESOLVE], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("env", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"},
                                 {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}])
def test_env_cap_makes_auto_fp32_on_the_cpu(env):
    # whatever this CPU is, kernels capped at AVX2 run bf16 emulated
    assert _resolve_in_child(**env)[:3] == ["fp32", "bf16", "bf16"]


def test_uncapped_auto_follows_this_cpu():
    *resolved, capability = _resolve_in_child()
    info = read_host_cpu()
    native = info is not None and any(f in info.flags for f in BF16_FLAGS) and capability == "AVX512"
    assert resolved == ["bf16" if native else "fp32", "bf16", "bf16"]
