"""GPU checks: driver and torch build, GPU count and health (ECC, thermals, leftovers, Xid)."""

from __future__ import annotations

import re

from orbitctl.doctor.findings import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, worst
from orbitctl.doctor.registry import (
    NO_GPU, NO_GPU_FIX, CheckContext, Outcome, check, fail_if, field_unknown, gpu_label, no_gpu_outcome, size_gib,
)
from orbitctl.doctor.snapshot import Snapshot
from orbitctl.doctor.xid import XID_RE, classify_xid
from orbitctl.units import GiB

# A foreign process holding this share of a GPU will make a run planned for the whole GPU OOM.
FOREIGN_FAIL_SHARE = 0.10
# Memory the driver keeps on an idle GPU; more than this with no process listed is someone else's.
IDLE_USED_BYTES = GiB


@check("env.nvml", "GPU", "NVIDIA driver visible (NVML)")
def env_nvml(s: Snapshot, ctx: CheckContext) -> Outcome:
    nv = s.nvml
    if nv.status == "ok" and nv.gpus:
        cuda = f", CUDA {nv.cuda_driver_version // 1000}.{nv.cuda_driver_version % 1000 // 10}" if nv.cuda_driver_version else ""
        return Outcome(PASS, [f"driver {nv.driver_version}{cuda}, {len(nv.gpus)} GPU(s)"])
    gone = no_gpu_outcome(s)
    assert gone is not None
    if gone.status == SKIP:
        gone.evidence = [f"{NO_GPU} (NVML: {nv.detail or nv.status})"]
        gone.fix = NO_GPU_FIX
    return gone


@check("env.torch", "GPU", "torch build can use the GPUs")
def env_torch(s: Snapshot, ctx: CheckContext) -> Outcome:
    t = s.torch
    gpus = s.has_gpus
    if t.status == "error":
        return Outcome(UNKNOWN, [f"torch probe failed: {t.detail}"], "Run `python -c 'import torch'` to see the error")
    if t.status == "missing":
        if gpus:
            return Outcome(FAIL, [f"torch is not importable ({t.detail}) on a machine with GPUs"],
                           "pip install torch --index-url https://download.pytorch.org/whl/cu128")
        return Outcome(SKIP, [f"torch not installed; {NO_GPU}"])
    build = f"torch {t.version} (CUDA build {t.cuda or 'none'}{', HIP ' + t.hip if t.hip else ''})"
    if not gpus:
        return Outcome(SKIP, [build, NO_GPU])
    if not t.cuda and not t.hip:
        return Outcome(FAIL, [build, f"{len(s.nvml.gpus)} NVIDIA GPU(s) present but this is a CPU-only wheel"],
                       "pip uninstall -y torch && pip install torch --index-url https://download.pytorch.org/whl/cu128")
    if not t.cuda_available:
        return Outcome(FAIL, [build, f"torch.cuda.is_available() is False{': ' + t.detail if t.detail else ''}",
                              f"CUDA_VISIBLE_DEVICES={s.env.get('CUDA_VISIBLE_DEVICES', '<unset>')}"],
                       "unset CUDA_VISIBLE_DEVICES (or list the GPU indices); in a container run with `--gpus all`; "
                       "check the driver is new enough for the wheel (ver.driver)")
    return Outcome(PASS, [build, f"{t.device_count} device(s) visible to torch"])


def _version_pair(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


@check("ver.driver", "GPU", "driver supports the torch CUDA version", min_gpus=1)
def ver_driver(s: Snapshot, ctx: CheckContext) -> Outcome:
    wheel = _version_pair(s.torch.cuda)
    if wheel is None:
        return Outcome(SKIP, ["torch has no CUDA build to compare (see env.torch)"])
    if s.nvml.cuda_driver_version is None:
        return Outcome(UNKNOWN, ["NVML did not report the driver's CUDA version"])
    drv = (s.nvml.cuda_driver_version // 1000, s.nvml.cuda_driver_version % 1000 // 10)
    ev = [f"driver {s.nvml.driver_version} supports CUDA {drv[0]}.{drv[1]}; torch built for CUDA {wheel[0]}.{wheel[1]}"]
    fix = (f"Upgrade the NVIDIA driver to one for CUDA >= {wheel[0]}.{wheel[1]}, or install an older wheel, e.g. "
           f"pip install torch --index-url https://download.pytorch.org/whl/cu{drv[0]}{drv[1]}")
    if drv[0] < wheel[0]:
        return Outcome(FAIL, ev, fix)
    if drv < wheel:
        ev.append("same major version: runs through minor-version compatibility (driver >= 525 for 12.x, >= 580 for 13.x), "
                  "PTX JIT of newer kernels can fail")
        return Outcome(WARN, ev, fix)
    return Outcome(PASS, ev)


@check("ver.arch", "GPU", "torch has kernels for this GPU architecture", min_gpus=1)
def ver_arch(s: Snapshot, ctx: CheckContext) -> Outcome:
    if not s.torch.cuda:
        return Outcome(SKIP, ["no CUDA torch build (see env.torch)"])
    if not s.torch.arch_list:
        return Outcome(UNKNOWN, ["torch.cuda.get_arch_list() was not read"])
    caps = {tuple(g.compute_capability) for g in s.nvml.gpus if g.compute_capability}
    caps |= {tuple(c) for c in s.torch.capabilities}
    if not caps:
        return Outcome(UNKNOWN, ["no compute capability reported"])
    arch = s.torch.arch_list
    missing = [f"sm_{a}{b}" for a, b in sorted(caps) if not arch_supported((a, b), arch)]
    ev = [f"GPU capability {', '.join(f'sm_{a}{b}' for a, b in sorted(caps))}; wheel has {' '.join(arch)}"]
    if missing:
        return Outcome(FAIL, ev + [f"no kernel image for {', '.join(missing)}"],
                       "Install a torch wheel built for this GPU (a newer cuXXX wheel), e.g. "
                       "pip install torch --index-url https://download.pytorch.org/whl/cu128")
    return Outcome(PASS, ev)


def arch_supported(cap: tuple[int, int], arch_list: list[str]) -> bool:
    """SASS for the same major and a lower-or-equal minor runs; PTX (compute_XY) JITs to newer GPUs."""
    for entry in arch_list:
        m = re.match(r"(sm|compute)_(\d+?)(\d)a?$", entry)
        if not m:
            continue
        major, minor = int(m.group(2)), int(m.group(3))
        if m.group(1) == "sm" and major == cap[0] and minor <= cap[1]:
            return True
        if m.group(1) == "compute" and (major, minor) <= cap:
            return True
    return False


@check("ver.nccl", "NCCL", "one NCCL library (torch's own)")
def ver_nccl(s: Snapshot, ctx: CheckContext) -> Outcome:
    if not s.torch.cuda:
        return Outcome(SKIP, ["no CUDA torch build: NCCL not used"])
    want = s.torch.nccl_version
    if not want:
        return Outcome(UNKNOWN, ["torch.cuda.nccl.version() was not read"])
    loaded = s.host.loaded_nccl or []
    ev = [f"torch NCCL {want}", f"loaded: {', '.join(loaded) or 'none seen in /proc/self/maps'}"]
    bad = []
    for path in loaded:
        m = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)", path)
        if m and m.group(1) != want:
            bad.append(f"{path} is NCCL {m.group(1)}, torch was built against {want}")
    for var in ("LD_PRELOAD", "LD_LIBRARY_PATH"):
        if "nccl" in s.env.get(var, "").lower():
            bad.append(f"{var} points at an NCCL build: {s.env[var]}")
    return Outcome(WARN, ev + bad, "unset LD_PRELOAD; unset LD_LIBRARY_PATH (or drop its NCCL entry) so torch loads its own libnccl") \
        if bad else Outcome(PASS, ev)


@check("ver.uniform", "GPU", "all GPUs alike (model, VBIOS)", min_gpus=1)
def ver_uniform(s: Snapshot, ctx: CheckContext) -> Outcome:
    names = {g.name for g in s.nvml.gpus if g.name}
    vbios = {g.vbios for g in s.nvml.gpus if g.vbios}
    bad = []
    if len(names) > 1:
        bad.append(f"mixed GPU models: {', '.join(sorted(names))}")
    if len(vbios) > 1:
        bad.append(f"VBIOS differs: {', '.join(sorted(vbios))}")
    return fail_if(bad, f"{len(s.nvml.gpus)} x {next(iter(names), '?')}, VBIOS {next(iter(vbios), '?')}", WARN,
                   "Flash every GPU to the same VBIOS (vendor tool) and use one GPU model per node")


@check("gpu.count", "GPU", "GPU count as expected")
def gpu_count(s: Snapshot, ctx: CheckContext) -> Outcome:
    expect = ctx.expect_gpus or (ctx.profile.hardware.gpus_per_node if ctx.profile is not None
                                 and ctx.profile.hardware.gpu != "cpu" else None)
    found = len(s.nvml.gpus) if s.nvml.status == "ok" else 0
    if not s.has_gpus:
        if expect:
            return Outcome(FAIL, [f"expected {expect} GPUs, found none ({NO_GPU})"],
                           "Check the driver (nvidia-smi), the container's `--gpus all`, and `dmesg | grep -i xid` for Xid 79")
        return no_gpu_outcome(s)
    ev = [f"NVML sees {found} GPU(s)"]
    bad = []
    visible = s.env.get("CUDA_VISIBLE_DEVICES")
    want_torch = found if visible is None else len([v for v in visible.split(",") if v.strip()])
    if s.torch.cuda_available and s.torch.device_count is not None:
        ev.append(f"torch sees {s.torch.device_count}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
        if s.torch.device_count != min(want_torch, found):
            bad.append(f"torch sees {s.torch.device_count}, expected {min(want_torch, found)}")
    if expect and found < expect:
        bad.append(f"expected {expect} GPUs, NVML sees {found}")
    return Outcome(FAIL, ev + bad, "Check CUDA_VISIBLE_DEVICES, the container's --gpus/cgroup device list, and the kernel "
                   "log for Xid 79 (a GPU that fell off the bus)") if bad else Outcome(PASS, ev)


@check("gpu.lost", "GPU", "no GPU lost (fallen off the bus)", min_gpus=1)
def gpu_lost(s: Snapshot, ctx: CheckContext) -> Outcome:
    bad = [f"{gpu_label(g)} is lost (NVML GPU_IS_LOST)" for g in s.nvml.gpus if g.lost]
    return fail_if(bad, "every GPU answers", fix="Reboot the node; reseat the GPU and check its power; RMA if it repeats")


@check("gpu.fabric", "GPU", "NVSwitch fabric manager ready", min_gpus=1)
def gpu_fabric(s: Snapshot, ctx: CheckContext) -> Outcome:
    states = {g.index: g.fabric_state for g in s.nvml.gpus}
    if all(v in (None, "not_supported") for v in states.values()):
        if any(g.errors.get("fabric") == "no_permission" for g in s.nvml.gpus):
            return Outcome(UNKNOWN, ["fabric state: no permission"])
        return Outcome(SKIP, ["no NVSwitch fabric on these GPUs"])
    bad = [f"GPU {i}: fabric state {v}" for i, v in states.items() if v not in ("completed", None, "not_supported")]
    return fail_if(bad, "fabric state COMPLETED on every GPU",
                   fix="sudo systemctl enable --now nvidia-fabricmanager  (its version must equal the driver's); "
                       "CUDA fails with Error 802 'system not yet initialized' until it is up")


@check("gpu.busy", "GPU", "no foreign or dead process holding GPU memory", min_gpus=1)
def gpu_busy(s: Snapshot, ctx: CheckContext) -> Outcome:
    if all(g.processes is None for g in s.nvml.gpus):
        return field_unknown(s.nvml.gpus, "processes", "running processes")
    job = running_job(s)
    if job:
        return Outcome(WARN, [f"a job runs on every GPU: {job}; memory checks see its memory",
                              "run the doctor between jobs for a clean reading of leftovers"],
                       "If the job is stale: kill its ranks (pids above); if it is live, nothing to do")
    fails, warns = [], []
    for g in s.nvml.gpus:
        listed = 0
        for p in g.processes or []:
            listed += p.used_bytes or 0
            if p.own:
                continue
            what = f"{gpu_label(g)}: pid {p.pid}{' (' + p.name + ')' if p.name else ''} holds {size_gib(p.used_bytes)}"
            if p.alive is False:
                fails.append(what + " but the process is gone (zombie allocation)")
            elif g.memory_total_bytes and (p.used_bytes or 0) >= FOREIGN_FAIL_SHARE * g.memory_total_bytes:
                fails.append(what + f" ({(p.used_bytes or 0) / g.memory_total_bytes:.0%} of the GPU)")
            else:
                warns.append(what)
        if g.processes == [] and (g.memory_used_bytes or 0) > IDLE_USED_BYTES:
            warns.append(f"{gpu_label(g)}: {size_gib(g.memory_used_bytes)} in use by processes NVML cannot list "
                         "(another container?)")
    fix = ("Stop the stale job: kill <pid> (check `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`); "
           "for a dead PID still holding memory reset the GPU: sudo nvidia-smi -r -i <gpu>")
    if fails or warns:
        return Outcome(FAIL if fails else WARN, fails + warns, fix)
    return Outcome(PASS, ["no foreign processes on the GPUs"])


def running_job(s: Snapshot) -> str | None:
    """One live foreign process per GPU, all with one name: a data-parallel job, not leftovers."""
    procs = [g.processes or [] for g in s.nvml.gpus]
    if len(procs) < 2 or any(len(p) != 1 or p[0].own or p[0].alive is False for p in procs):
        return None
    names = {p[0].name for p in procs}
    if len(names) != 1:
        return None
    return f"{len(procs)} x {names.pop() or 'process'} (pids {', '.join(str(p[0].pid) for p in procs)})"


@check("gpu.persist", "GPU", "persistence mode on", min_gpus=1)
def gpu_persist(s: Snapshot, ctx: CheckContext) -> Outcome:
    if all(g.persistence_mode is None for g in s.nvml.gpus):
        return field_unknown(s.nvml.gpus, "persistence_mode", "persistence mode")
    off = [gpu_label(g) for g in s.nvml.gpus if g.persistence_mode is False]
    return fail_if([f"persistence mode off on {', '.join(off)}"] if off else [], "persistence mode on", WARN,
                   "sudo nvidia-smi -pm 1   (or enable the nvidia-persistenced service)")


@check("ecc.dbe", "GPU", "no uncorrected ECC errors", min_gpus=1)
def ecc_dbe(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = s.nvml.gpus
    if all(g.ecc_volatile_uncorrected is None and g.ecc_aggregate_uncorrected is None for g in gpus):
        return field_unknown(gpus, "ecc.volatile", "ECC counters")
    vol = [f"{gpu_label(g)}: {g.ecc_volatile_uncorrected} uncorrected ECC errors since boot"
           for g in gpus if (g.ecc_volatile_uncorrected or 0) > 0]
    agg = [f"{gpu_label(g)}: {g.ecc_aggregate_uncorrected} uncorrected ECC errors over its life"
           for g in gpus if (g.ecc_aggregate_uncorrected or 0) > 0 and not (g.ecc_volatile_uncorrected or 0)]
    fix = "Drain the node, reset the GPU (sudo nvidia-smi -r -i <gpu>), run `dcgmi diag -r 3`; RMA if errors return"
    if vol:
        return Outcome(FAIL, vol + agg, fix)
    return Outcome(WARN, agg, fix) if agg else Outcome(PASS, ["0 uncorrected ECC errors"])


@check("ecc.remap", "GPU", "row remapping healthy", min_gpus=1)
def ecc_remap(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = s.nvml.gpus
    if all(g.remapped_rows is None for g in gpus):
        return field_unknown(gpus, "remapped_rows", "row remapping")
    failed = [f"{gpu_label(g)}: row remapping FAILED" for g in gpus if g.remapped_rows and g.remapped_rows.failure]
    pending = [f"{gpu_label(g)}: row remap pending" for g in gpus if g.remapped_rows and g.remapped_rows.pending]
    if failed:
        return Outcome(FAIL, failed + pending, "Drain the node and RMA the GPU (no spare rows left)")
    if pending:
        return Outcome(WARN, pending, "Reset the GPU when idle to activate the remap: sudo nvidia-smi -r -i <gpu>")
    return Outcome(PASS, ["no pending or failed row remaps"])


@check("therm.temp", "GPU", "temperature below slowdown", min_gpus=1)
def therm_temp(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = [g for g in s.nvml.gpus if g.temperature_c is not None]
    if not gpus:
        return field_unknown(s.nvml.gpus, "temperature", "temperature")
    statuses, ev = [], []
    for g in gpus:
        thr = g.slowdown_c
        if thr is None:
            statuses.append(PASS if g.temperature_c < 85 else WARN)
            ev.append(f"{gpu_label(g)}: {g.temperature_c} C (slowdown threshold not reported)")
            continue
        st = FAIL if g.temperature_c >= thr else WARN if g.temperature_c >= thr - 5 else PASS
        statuses.append(st)
        if st != PASS:
            ev.append(f"{gpu_label(g)}: {g.temperature_c} C, slowdown at {thr} C")
    status = worst(statuses)
    if status == PASS:
        return Outcome(PASS, [f"max {max(g.temperature_c for g in gpus)} C"] + ev)
    return Outcome(status, ev, "Check airflow, fans and inlet temperature; `nvidia-smi -q -d TEMPERATURE,PERFORMANCE`")


HW_BITS = {0x8: "HwSlowdown", 0x40: "HwThermalSlowdown", 0x80: "HwPowerBrakeSlowdown"}
SW_BITS = {0x4: "SwPowerCap", 0x20: "SwThermalSlowdown"}
BUSY_PCT = 30


@check("therm.clk", "GPU", "no hardware clock throttling", min_gpus=1)
def therm_clk(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = [g for g in s.nvml.gpus if g.clock_event_reasons is not None]
    if not gpus:
        return field_unknown(s.nvml.gpus, "clock_event_reasons", "clock event reasons")
    hw, sw = [], []
    for g in gpus:
        r = g.clock_event_reasons
        names = [n for bit, n in HW_BITS.items() if r & bit]
        if names:
            hw.append(f"{gpu_label(g)}: {', '.join(names)} (reasons 0x{r:x})")
        soft = [n for bit, n in SW_BITS.items() if r & bit]
        if soft:
            busy = (g.utilization_pct or 0) >= BUSY_PCT
            sw.append((busy, f"{gpu_label(g)}: {', '.join(soft)} at {g.utilization_pct}% load"))
    fix = "Check cooling and power delivery (PSU, cables); `nvidia-smi -q -d PERFORMANCE`; remove a low power cap: sudo nvidia-smi -pl <watts>"
    if hw:
        return Outcome(FAIL, hw + [t for _, t in sw], fix)
    if any(busy for busy, _ in sw):
        return Outcome(WARN, [t for _, t in sw], fix)
    if sw:
        return Outcome(INFO, [t for _, t in sw] + ["idle: software caps are normal when idle"])
    return Outcome(PASS, ["no throttle reasons besides idle/app clocks"])


@check("xid.recent", "GPU", "no recent Xid errors in the kernel log")
def xid_recent(s: Snapshot, ctx: CheckContext) -> Outcome:
    k = s.kernel_log
    if k.status != "ok":
        return Outcome(UNKNOWN, [f"kernel log not readable: {k.detail or k.status}"],
                       "Run as root, or allow it: sudo sysctl kernel.dmesg_restrict=0")
    found: dict[int, int] = {}
    for line in k.xid_lines:
        m = XID_RE.search(line)
        if m:
            code = int(m.group("xid"))
            found[code] = found.get(code, 0) + 1
        elif "fallen off the bus" in line:
            found[79] = found.get(79, 0) + 1
    if not found:
        return Outcome(PASS, [f"no Xid lines in {k.source}"])
    ev, statuses, fixes = [], [], []
    for code, n in sorted(found.items()):
        sev, meaning, fix = classify_xid(code)
        statuses.append(sev)
        ev.append(f"Xid {code} x{n}: {meaning}")
        if sev != INFO:
            fixes.append(f"Xid {code}: {fix}")
    return Outcome(worst(statuses), ev, "; ".join(fixes) or None, {"xids": found})
