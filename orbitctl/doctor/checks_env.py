"""Environment checks: NCCL variables, /dev/shm, MASTER_PORT, allocator config, host RAM, stale op-build locks."""

from __future__ import annotations

from orbitctl.doctor.findings import FAIL, INFO, PASS, UNKNOWN, WARN
from orbitctl.doctor.registry import CheckContext, Outcome, check, size_gib
from orbitctl.doctor.snapshot import Snapshot
from orbitctl.units import GiB, MiB

# Old names torch still reads but warns about.
RENAMED = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
}
SHM_WARN = 512 * MiB
SHM_FAIL = 256 * MiB


def _nvlink_up(s: Snapshot) -> bool:
    return any(any(g.nvlink_active or []) for g in s.nvml.gpus)


def ifname_matches(spec: str, interfaces: list[str]) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma list of prefixes, '=' exact, '^' exclude."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]

    def hit(iface: str) -> bool:
        return any(iface == n if exact else iface.startswith(n) for n in names)

    return any(not hit(i) for i in interfaces) if exclude else any(hit(i) for i in interfaces)


@check("nccl.env", "NCCL", "NCCL environment sane")
def nccl_env(s: Snapshot, ctx: CheckContext) -> Outcome:
    env, fails, warns, fixes = s.env, [], [], []
    for old, new in RENAMED.items():
        if old in env:
            warns.append(f"{old}={env[old]} is deprecated")
            fixes.append(f"unset {old}; export {new}={env[old]}")
    if env.get("NCCL_P2P_DISABLE") == "1" and _nvlink_up(s):
        warns.append("NCCL_P2P_DISABLE=1 on a machine with NVLink up: all GPU traffic goes through host memory")
        fixes.append("unset NCCL_P2P_DISABLE")
    nodes = getattr(getattr(ctx.profile, "hardware", None), "nodes", 1) or 1
    if env.get("NCCL_IB_DISABLE") == "1" and nodes > 1:
        warns.append(f"NCCL_IB_DISABLE=1 with {nodes} nodes: inter-node traffic falls back to TCP sockets")
        fixes.append("unset NCCL_IB_DISABLE")
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and s.host.net_interfaces is not None and not ifname_matches(ifname, s.host.net_interfaces):
        fails.append(f"NCCL_SOCKET_IFNAME={ifname} matches none of: {' '.join(s.host.net_interfaces)}")
        usable = [i for i in s.host.net_interfaces if i != "lo" and not i.startswith(("docker", "veth", "virbr"))]
        fixes.append(f"export NCCL_SOCKET_IFNAME={usable[0] if usable and nodes > 1 else 'lo'}"
                     + ("   (one node: lo is enough)" if nodes == 1 else ""))
    if env.get("CUDA_LAUNCH_BLOCKING") == "1":
        warns.append("CUDA_LAUNCH_BLOCKING=1 serialises every kernel (debugging only)")
        fixes.append("unset CUDA_LAUNCH_BLOCKING")
    if env.get("NCCL_DEBUG", "").upper() == "TRACE":
        warns.append("NCCL_DEBUG=TRACE slows every collective")
        fixes.append("export NCCL_DEBUG=WARN")
    if fails or warns:
        return Outcome(FAIL if fails and s.has_gpus else WARN, fails + warns, "; ".join(fixes))
    shown = [f"{k}={v}" for k, v in s.env.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))]
    return Outcome(PASS, shown or ["no NCCL_* variables set (defaults)"])


@check("nccl.shm", "NCCL", "/dev/shm large enough for NCCL")
def nccl_shm(s: Snapshot, ctx: CheckContext) -> Outcome:
    shm = s.host.shm
    fix = "docker run --shm-size=16g ... (Kubernetes: an emptyDir with medium: Memory on /dev/shm); remove stale /dev/shm/nccl-* files"
    if shm.status == "missing" and s.has_gpus:
        return Outcome(FAIL, ["/dev/shm does not exist"], fix)
    if shm.total_bytes is None:
        return Outcome(UNKNOWN, ["/dev/shm could not be read"])
    ev = [f"/dev/shm {size_gib(shm.total_bytes)}, {size_gib(shm.free_bytes)} free"]
    if not s.has_gpus:
        return Outcome(INFO, ev + ["no GPU: NCCL will not use it (DataLoader workers still do)"])
    free = shm.free_bytes if shm.free_bytes is not None else shm.total_bytes
    if shm.total_bytes < SHM_FAIL or free < SHM_FAIL:
        return Outcome(FAIL, ev + ["below 256 MiB: NCCL's shared-memory transport will fail to create its segments"], fix)
    if shm.total_bytes < SHM_WARN or free < SHM_WARN:
        return Outcome(WARN, ev + ["below 512 MiB (DeepSpeed's ds_report warns here)"], fix)
    return Outcome(PASS, ev)


@check("net.port", "NCCL", "MASTER_PORT free")
def net_port(s: Snapshot, ctx: CheckContext) -> Outcome:
    mp = s.master_port
    if mp.port is None:
        return Outcome(UNKNOWN if not mp.error else FAIL, [mp.error or "MASTER_PORT not probed"], "export MASTER_PORT=29500")
    if mp.bindable is False:
        # without GPUs this machine runs no NCCL job: a busy port is worth a warning, not a failure
        return Outcome(FAIL if s.has_gpus else WARN, [f"port {mp.port} is in use ({mp.error})"],
                       f"Find and stop the stale job: ss -ltnp 'sport = :{mp.port}'; or pick another port: "
                       f"export MASTER_PORT={mp.port + 1}  (torchrun --master_port {mp.port + 1}, or --rdzv-endpoint localhost:0)")
    if mp.bindable is None:
        return Outcome(UNKNOWN, [f"port {mp.port}: {mp.error}"])
    return Outcome(PASS, [f"port {mp.port} can be bound"])


@check("env.alloc", "memory", "allocator configured against fragmentation", min_gpus=1)
def env_alloc(s: Snapshot, ctx: CheckContext) -> Outcome:
    conf = s.env.get("PYTORCH_CUDA_ALLOC_CONF")
    new = s.env.get("PYTORCH_ALLOC_CONF")
    if conf and new and conf != new:
        return Outcome(WARN, [f"PYTORCH_CUDA_ALLOC_CONF={conf} and PYTORCH_ALLOC_CONF={new} disagree"],
                       f"export PYTORCH_ALLOC_CONF={new}; unset PYTORCH_CUDA_ALLOC_CONF")
    value = new or conf or ""
    if "expandable_segments:true" in value.replace(" ", "").lower():
        return Outcome(PASS, [f"allocator: {value}"])
    return Outcome(INFO, [f"allocator: {value or 'defaults'} (fixed-size segments fragment when shapes vary)"],
                   "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


@check("host.ram", "memory", "host RAM available")
def host_ram(s: Snapshot, ctx: CheckContext) -> Outcome:
    total, avail = s.host.mem_total_bytes, s.host.mem_available_bytes
    if total is None or avail is None:
        return Outcome(UNKNOWN, ["/proc/meminfo not read"])
    ev = [f"{size_gib(total)} total, {size_gib(avail)} available"]
    want = getattr(getattr(ctx.profile, "hardware", None), "host_ram_gib", None)
    if want is not None and total < 0.95 * want * GiB:
        return Outcome(WARN, ev + [f"the profile assumes {want:g} GiB (hardware.host_ram_gib)"],
                       f"orbitctl plan PROFILE --set hardware.host_ram_gib={int(total / GiB)}")
    if avail < 0.10 * total:
        return Outcome(WARN, ev + ["under 10% available: offload and data loaders risk the OOM killer (exit code -9)"],
                       "Stop other jobs on the node, or reduce offload (memory.offload_optimizer / offload_params)")
    return Outcome(PASS, ev)



@check("env.build_locks", "host", "no op build lock left by a killed build")
def env_build_locks(s: Snapshot, ctx: CheckContext) -> Outcome:
    locks = s.host.stale_build_locks
    if locks is None:
        return Outcome(UNKNOWN, ["the JIT extension build directories were not looked at"])
    if not locks:
        return Outcome(PASS, ["no lock file that no process holds under the JIT extension build directories"])
    return Outcome(WARN, [f"{lock}: no process holds it; a DeepSpeed op build (every train's process group on a CPU) "
                          f"waits for it forever" for lock in locks]
                   + ["orbitctl train removes such a lock itself before it starts its process group"],
                   "rm " + " ".join(locks))
