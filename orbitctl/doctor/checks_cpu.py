"""The CPU check: model, ISA, torch's kernel capability, and the dtype CPU profiles compute in."""

from __future__ import annotations

from orbitctl.doctor.findings import INFO, PASS, UNKNOWN, WARN
from orbitctl.doctor.registry import CheckContext, Outcome, check
from orbitctl.doctor.snapshot import Snapshot
from orbitctl.model.cpu_dtype import bf16_verdict, onednn_cap, resolve_dtype

ISA_NAMES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))
SLOWDOWN = "bf16 matmuls are emulated there, about 45x slower than fp32 (AVX2-only EPYC: 3.5 ms against 76 us)"


def _forced_bf16(profile) -> list[str]:
    """The profile's dtype keys set to bf16 (not auto), when it runs on the CPU."""
    if profile is None or profile.hardware.gpu != "cpu":
        return []
    keys = (("quant.compute_dtype", profile.quant.compute_dtype), ("adapter.dtype", profile.adapter.dtype))
    return [key for key, value in keys if value == "bf16"]


@check("host.cpu", "host", "CPU runs bf16 natively (what dtype auto is on the CPU)")
def host_cpu(s: Snapshot, ctx: CheckContext) -> Outcome:
    cpu = s.host.cpu
    if cpu.status != "ok":
        why = "could not be read" if cpu.status == "unreadable" else "not in this snapshot"
        return Outcome(UNKNOWN, [f"/proc/cpuinfo {why}" + (f" (CPU: {cpu.model})" if cpu.model else "")])
    flags = frozenset(cpu.flags)
    capability = s.torch.cpu_capability if s.torch.status == "ok" else None
    verdict = bf16_verdict(flags, capability, s.env)
    auto = resolve_dtype("auto", "cpu", cpu_native_bf16=verdict.native)
    isa = ", ".join(f"{name} {'yes' if flag in flags else 'no'}" for flag, name in ISA_NAMES)
    onednn = onednn_cap(s.env)
    kernels = f"kernels: torch {capability or 'not probed'}, oneDNN {f'up to {onednn.upper()}' if onednn else 'uncapped'}"
    evidence = [f"CPU: {cpu.model or 'unknown model'}" + (f" ({cpu.arch})" if cpu.arch else ""), f"ISA: {isa}", kernels,
                f"{verdict.reason}: CPU profiles with dtype auto compute in {auto}"]
    data = {"model": cpu.model, "flags": sorted(flags), "kernel_capability": capability,
            "capped_by": list(verdict.capped_by), "native_bf16": verdict.native, "auto_dtype": auto}
    uncap = f"unset {' '.join(c.split('=')[0] for c in verdict.capped_by if '=' in c)}" if verdict.capped_by else None
    forced = [] if verdict.native else _forced_bf16(ctx.profile)
    if forced:
        sets = " ".join(f"--set {key}=auto" for key in forced)
        fix = f"set {' and '.join(forced)} to auto in the profile (fp32 here), e.g. {sets}"
        return Outcome(WARN, evidence + [f"the profile forces bf16 ({', '.join(forced)}) on this CPU: {SLOWDOWN}"],
                       f"{uncap}, or {fix}" if uncap else fix, data)
    if verdict.native:
        return Outcome(PASS, evidence, None, data)
    return Outcome(INFO, evidence, f"{uncap} to let the kernels use the CPU's bf16" if uncap else None, data)
