"""What ``auto`` means for a dtype here: bf16 where it runs natively, else fp32.

    from orbitctl.kernels.cpu_dtype import resolve_dtype, resolved_dtype, torch_dtype
    resolve_dtype("auto", "cpu", cpu_native_bf16=False)   # 'fp32' (the rule, a pure function)
    resolved_dtype("auto", "cpu")                          # the rule on this host
    torch_dtype("auto", "cuda:0")                          # torch.bfloat16

The rule (:func:`resolve_dtype`): bf16, fp16 and fp32 stay as they are; ``auto`` is bf16 on a
CUDA device, and on the CPU bf16 when the CPU runs bf16 natively, else fp32. "Natively" means
the CPU has AVX512-BF16 or AMX-BF16 *and* nothing caps the kernels below them: torch's kernel
capability (``torch.backends.cpu.get_cpu_capability()``, lowered by ``ATEN_CPU_CAPABILITY``)
is AVX512, and ``ONEDNN_MAX_CPU_ISA`` (or the older ``DNNL_MAX_CPU_ISA``), when set, allows
oneDNN's bf16 kernels. Without them a bf16 matmul is emulated: on an AVX2-only EPYC a
256x64x256 bf16 matmul takes 3.5 ms against 76 us in fp32 (45x).

Nothing here imports torch at import time: the doctor applies the same rule to a snapshot.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from typing import Mapping

from orbitctl.units import TORCH_DTYPE_NAMES

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (as /proc/cpuinfo spells them) of native bf16 arithmetic."""
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The flags worth showing next to a CPU model."""
CAP_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Environment variables that lower the CPU kernels torch and oneDNN pick."""
# oneDNN's ISA names, lowest first; a cap at one of them allows it and everything before it
ONEDNN_ISAS = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni",
               "avx512_core_bf16", "avx10_1_512", "avx10_1_512_amx", "avx10_1_512_amx_fp16", "avx10_2_512",
               "avx10_2_512_amx_2")
ONEDNN_ALIASES = {"avx512_core_fp16": "avx10_1_512", "avx512_core_amx": "avx10_1_512_amx",
                  "avx512_core_amx_fp16": "avx10_1_512_amx_fp16"}
ONEDNN_UNCAPPED = ("all", "default", "")


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as /proc/cpuinfo (or, without it, torch's cpuinfo) describes it."""

    model: str | None
    flags: frozenset[str]
    arch: str = ""

    def isa(self) -> list[str]:
        """The shown ISA flags this CPU has, e.g. ['avx2', 'avx512f', 'avx512_bf16']."""
        return [f for f in ISA_FLAGS if f in self.flags]


@dataclass(frozen=True)
class Bf16Verdict:
    """Whether bf16 runs natively on this CPU, and in one line why (not)."""

    native: bool
    reason: str
    capped_by: tuple[str, ...] = ()
    """Environment settings that lower the kernels below the CPU's own bf16 support."""


def resolve_dtype(name: str, device_type: str, *, cpu_native_bf16: bool) -> str:
    """The dtype a profile's ``bf16 | fp16 | fp32 | auto`` means on a device of ``device_type``.

    ``auto``: bf16 on an accelerator (cuda), on the CPU bf16 when it runs bf16 natively, else fp32.
    """
    if name != "auto":
        if name not in TORCH_DTYPE_NAMES:
            from orbitctl.errors import UserError

            raise UserError(f"dtype: unknown value '{name}'", fix="use bf16, fp16, fp32 or auto")
        return name
    if device_type != "cpu":
        return "bf16"
    return "bf16" if cpu_native_bf16 else "fp32"


def parse_cpuinfo(text: str, arch: str = "") -> CpuInfo:
    """Model name and flags of the first processor in a /proc/cpuinfo text (x86 ``flags``, Arm ``Features``)."""
    model, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and model is None and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = frozenset(value.split())
    return CpuInfo(model, flags or frozenset(), arch)


def onednn_cap(env: Mapping[str, str]) -> str | None:
    """The oneDNN ISA cap set in ``env`` (lowercase), or None when oneDNN may use the whole CPU."""
    value = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    return None if value in ONEDNN_UNCAPPED else value


def onednn_allows(cap: str | None, isa: str) -> bool:
    """Whether oneDNN under the ``cap`` (:func:`onednn_cap`) may use its ISA ``isa`` (its names, :data:`ONEDNN_ISAS`)."""
    if cap is None:
        return True
    cap = ONEDNN_ALIASES.get(cap, cap)
    if cap not in ONEDNN_ISAS:  # oneDNN ignores a name it does not know
        return True
    return ONEDNN_ISAS.index(cap) >= ONEDNN_ISAS.index(ONEDNN_ALIASES.get(isa, isa))


def bf16_verdict(flags: frozenset[str] | set[str], kernel_capability: str | None,
                 env: Mapping[str, str]) -> Bf16Verdict:
    """Whether a CPU with ``flags`` runs bf16 natively under ``kernel_capability`` and ``env``.

    ``kernel_capability`` is ``torch.backends.cpu.get_cpu_capability()`` (AVX512, AVX2, DEFAULT,
    ...), which already honours ``ATEN_CPU_CAPABILITY``; None (torch not asked) reads that variable.
    """
    present = [f for f in BF16_FLAGS if f in flags]
    if not present:
        return Bf16Verdict(False, "the CPU has neither AVX512-BF16 nor AMX-BF16: bf16 matmuls are emulated")
    capped: list[str] = []
    if kernel_capability is not None:
        if kernel_capability.upper() != "AVX512":
            aten = env.get("ATEN_CPU_CAPABILITY")
            capped.append(f"ATEN_CPU_CAPABILITY={aten}" if aten else f"torch kernel capability {kernel_capability}")
    else:
        aten = (env.get("ATEN_CPU_CAPABILITY") or "").strip().lower()
        if aten and aten != "avx512":
            capped.append(f"ATEN_CPU_CAPABILITY={env['ATEN_CPU_CAPABILITY']}")
    cap = onednn_cap(env)
    needed = "avx512_core_bf16" if "avx512_bf16" in flags else "avx512_core_amx"
    if not onednn_allows(cap, needed):
        name = "ONEDNN_MAX_CPU_ISA" if env.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"
        capped.append(f"{name}={env[name]}")
    have = " and ".join(f.upper().replace("_", "-") for f in present)
    if capped:
        return Bf16Verdict(False, f"the CPU has {have}, but the kernels are capped below it ({', '.join(capped)})",
                           tuple(capped))
    return Bf16Verdict(True, f"the CPU has {have} and nothing caps the kernels below it")


def read_host_cpu(path: str = "/proc/cpuinfo") -> CpuInfo | None:
    """This machine's CPU from /proc/cpuinfo; None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return parse_cpuinfo(fh.read(), platform.machine())
    except OSError:
        return None


def _torch_cpu() -> tuple[CpuInfo, str]:
    """The CPU and the effective kernel capability as torch sees them (imports torch)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    info = read_host_cpu()
    if info is None:
        try:  # torch's own cpuinfo: the same flag names, where /proc/cpuinfo is not there
            features = torch._C._cpu._get_cpu_capability()
            info = CpuInfo(features.get("cpu_name"), frozenset(k for k, v in features.items() if v is True),
                           str(features.get("architecture") or platform.machine()))
        except Exception:
            info = CpuInfo(platform.processor() or None, frozenset(), platform.machine())
    return info, capability


@functools.cache
def host_bf16() -> Bf16Verdict:
    """Whether this process's CPU kernels run bf16 natively (imports torch; asked once)."""
    info, capability = _torch_cpu()
    return bf16_verdict(info.flags, capability, os.environ)


def device_type(device) -> str:
    """'cpu', 'cuda', ... from a device name or torch.device."""
    return str(getattr(device, "type", None) or device).split(":")[0]


def resolved_dtype(name: str, device="cpu") -> str:
    """``name`` resolved for ``device`` on this host: bf16, fp16 or fp32 (see :func:`resolve_dtype`)."""
    kind = device_type(device)
    native = host_bf16().native if name == "auto" and kind == "cpu" else False
    return resolve_dtype(name, kind, cpu_native_bf16=native)


def planned_dtype(name: str, device_type: str, env: Mapping[str, str] | None = None) -> str:
    """``name`` resolved without importing torch, for callers on a fast path (the planner): the CPU
    flags from /proc/cpuinfo and the caps from ``env``; torch's kernel capability is not asked."""
    native = False
    if name == "auto" and device_type == "cpu":
        info = read_host_cpu()
        native = info is not None and bf16_verdict(info.flags, None, os.environ if env is None else env).native
    return resolve_dtype(name, device_type, cpu_native_bf16=native)


def torch_dtype(name: str, device="cpu"):
    """The torch dtype of ``name`` (bf16, fp16, fp32 or auto) on ``device``."""
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[resolved_dtype(name, device)])


def describe(name: str, device="cpu") -> str:
    """'fp32' for a fixed dtype; 'fp32 (auto: the CPU has ... )' when ``name`` is auto."""
    resolved = resolved_dtype(name, device)
    if name != "auto":
        return resolved
    if device_type(device) != "cpu":
        return f"{resolved} (auto on {device_type(device)})"
    return f"{resolved} (auto: {host_bf16().reason})"


def run_device_type(profile) -> str:
    """'cuda' when the profile names a GPU and CUDA is there, else 'cpu' (as :func:`orbitctl.builder.policy_device`)."""
    if profile.hardware.gpu == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype_name(profile) -> str:
    """quant.compute_dtype resolved for where this profile runs: bf16, fp16 or fp32."""
    return resolved_dtype(profile.quant.compute_dtype, run_device_type(profile))


def dtype_summary(profile, device=None) -> str:
    """One line: the compute and adapter dtypes a run on ``device`` uses, and why when they came from auto."""
    device = device or run_device_type(profile)
    compute, adapter = describe(profile.quant.compute_dtype, device), describe(profile.adapter.dtype, device)
    return f"compute {compute}; adapter {adapter}" if adapter != compute else f"compute and adapter {compute}"
