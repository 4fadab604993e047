"""The CPU checks: model, ISA, torch's kernel capability and the dtype CPU profiles compute in (host.cpu); every ISA
feature with the OS state of its registers (host.isa, the `isa` table)."""

from __future__ import annotations

from orbitctl.doctor.findings import INFO, PASS, SKIP, UNKNOWN, WARN
from orbitctl.doctor.registry import CheckContext, Outcome, check
from orbitctl.doctor.snapshot import Snapshot
from orbitctl.kernels.cpu_dtype import bf16_verdict, onednn_cap, resolve_dtype

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


ISA_WARN_FIX = {
    "refused": "A process that runs AMX tile instructions gets SIGILL here unless its own arch_prctl(ARCH_REQ_XCOMP_PERM, "
               "XFEATURE_XTILEDATA) succeeds: EINVAL: a kernel before 5.16 (upgrade it); EOPNOTSUPP: the kernel or the "
               "hypervisor did not enable the tile state (enable AMX there); ENOSPC: give the process a larger "
               "sigaltstack. Until then keep libraries off AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; llama.cpp built "
               "with -DGGML_NATIVE=OFF and no GGML_AMX_*)",
    "disabled": "The CPU has these features but the OS does not save their registers (XCR0 lacks their state): their "
                "instructions fault with SIGILL. Build native libraries for what the OS enables (llama-cpp-python: "
                "CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install --no-cache-dir ...), or remove what disables the state "
                "(the kernel options noxsave or clearcpuid, a hypervisor CPU model without it)",
}


@check("host.isa", "host", "CPU ISA features and the OS state of their registers (the isa table)")
def host_isa(s: Snapshot, ctx: CheckContext) -> Outcome:
    from orbitctl.doctor.isa import isa_rows, render_table, xcr0_source

    cpu = s.host.cpu
    isa = cpu.isa
    if isa.status == "missing":
        return Outcome(UNKNOWN, ["the ISA table is not in this snapshot (taken by an older doctor)"])
    if isa.status == "unreadable":
        return Outcome(UNKNOWN, ["/proc/cpuinfo could not be read"])
    if isa.status == "not_x86":
        return Outcome(SKIP, [f"not an x86 CPU ({cpu.arch or 'unknown arch'}): the table lists x86 ISA features"])
    rows = isa_rows(isa)
    present = [r.feature for r in rows if r.cpu == "present"]
    absent = [r.feature for r in rows if r.cpu == "absent"]
    evidence = [f"present: {', '.join(present) or 'none'}; absent: {', '.join(absent) or 'none'}",
                f"OS state: {xcr0_source(isa)}"]
    evidence += render_table(rows)
    bad = [r for r in rows if r.cpu == "present" and r.os in ("refused", "disabled")]
    evidence += [f"{r.feature}: {r.detail}" for r in bad]
    data = {"isa": [r.to_dict() for r in rows], "xcr0": isa.xstate.xcr0, "xstate": isa.xstate.status}
    if bad:
        kinds = sorted({r.os for r in bad})
        return Outcome(WARN, evidence, "; ".join(ISA_WARN_FIX[k] for k in kinds), data)
    return Outcome(INFO, evidence, None, data)
