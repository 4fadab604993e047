"""Topology checks: PCIe links, NVLink, peer-to-peer, ACS/IOMMU and NUMA placement of ranks."""

from __future__ import annotations

from orbitctl.doctor.checks_gpu import BUSY_PCT
from orbitctl.doctor.findings import FAIL, INFO, PASS, UNKNOWN, WARN
from orbitctl.doctor.registry import CheckContext, Outcome, check, fail_if, field_unknown, gpu_label
from orbitctl.doctor.snapshot import Gpu, Snapshot
from orbitctl.doctor.sysfs import format_cpulist


def _link(g: Gpu) -> str:
    p = g.pcie
    return f"Gen{p.cur_gen} x{p.cur_width} (max Gen{p.max_gen} x{p.max_width})"


@check("pcie.width", "topology", "PCIe link at full width", min_gpus=1)
def pcie_width(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = [g for g in s.nvml.gpus if g.pcie.cur_width and g.pcie.max_width]
    if not gpus:
        return field_unknown(s.nvml.gpus, "pcie.cur_width", "PCIe link width")
    bad = [f"{gpu_label(g)}: x{g.pcie.cur_width} of x{g.pcie.max_width}" for g in gpus if g.pcie.cur_width < g.pcie.max_width]
    return fail_if(bad, f"all {len(gpus)} GPUs at x{gpus[0].pcie.max_width}",
                   fix="Re-check under load; then reseat the GPU or riser and check the BIOS slot bifurcation (x16)")


@check("pcie.gen", "topology", "PCIe link at full generation", min_gpus=1)
def pcie_gen(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = [g for g in s.nvml.gpus if g.pcie.cur_gen and g.pcie.max_gen]
    if not gpus:
        return field_unknown(s.nvml.gpus, "pcie.cur_gen", "PCIe generation")
    low = [g for g in gpus if g.pcie.cur_gen < g.pcie.max_gen]
    if not low:
        return Outcome(PASS, [f"all {len(gpus)} GPUs at Gen{gpus[0].pcie.max_gen}"])
    busy = [g for g in low if (g.utilization_pct or 0) >= BUSY_PCT]
    fix = "Set the slot to its full generation in the BIOS; replace the riser/retimer if it stays low under load"
    if busy:
        return Outcome(WARN, [f"{gpu_label(g)}: {_link(g)} at {g.utilization_pct}% load" for g in busy], fix)
    return Outcome(INFO, [f"{gpu_label(g)}: {_link(g)} while idle" for g in low]
                   + ["idle GPUs lower the link generation to save power; judge it under load"])


@check("pcie.replay", "topology", "PCIe replay counter steady", min_gpus=1)
def pcie_replay(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = [g for g in s.nvml.gpus if g.pcie.replay_counter is not None and g.pcie.replay_counter_later is not None]
    if not gpus:
        return field_unknown(s.nvml.gpus, "pcie.replay", "PCIe replay counter")
    rising = [f"{gpu_label(g)}: replays {g.pcie.replay_counter} -> {g.pcie.replay_counter_later}"
              for g in gpus if g.pcie.replay_counter_later > g.pcie.replay_counter]
    return fail_if(rising, "replay counters not rising", WARN,
                   "Reseat the GPU or replace the riser; check `dmesg | grep -i aer` for PCIe AER errors")


def _sxm(g: Gpu) -> bool:
    name = (g.name or "").upper()
    return "SXM" in name or "HBM" in name or g.fabric_state in ("completed", "in_progress", "not_started")


@check("nvl.links", "topology", "NVLink links up", min_gpus=1)
def nvl_links(s: Snapshot, ctx: CheckContext) -> Outcome:
    gpus = s.nvml.gpus
    if all(g.nvlink_active is None for g in gpus):
        if any(_sxm(g) for g in gpus):
            return Outcome(FAIL, ["SXM GPUs report no NVLink links"], "Check `nvidia-smi nvlink -s`; start nvidia-fabricmanager; RMA")
        return Outcome(INFO, ["no NVLink on these GPUs: GPU-to-GPU traffic goes over PCIe"])
    expected = max(sum(g.nvlink_active or []) for g in gpus)
    bad = []
    for g in gpus:
        links = g.nvlink_active or []
        up = sum(links)
        down = [i for i, on in enumerate(links) if not on]
        if up < expected or (_sxm(g) and down):
            bad.append(f"{gpu_label(g)}: {up} of {len(links)} links up" + (f", down: {down}" if down else ""))
    return fail_if(bad, f"{expected} NVLink links up on every GPU",
                   fix="Check `nvidia-smi nvlink -s` and the kernel log for Xid 74; reset the GPU; restart "
                       "nvidia-fabricmanager; RMA the board if the link stays down")


@check("topo.p2p", "topology", "peer-to-peer access between every GPU pair", min_gpus=2, too_few="one GPU: no pairs")
def topo_p2p(s: Snapshot, ctx: CheckContext) -> Outcome:
    if not s.nvml.pairs or all(p.p2p_read is None for p in s.nvml.pairs):
        return Outcome(UNKNOWN, ["P2P status was not read"])
    bad = [f"GPU {p.a} <-> GPU {p.b}: P2P read {p.p2p_read} (path {p.common_ancestor})"
           for p in s.nvml.pairs if p.p2p_read not in ("OK", None)]
    return fail_if(bad, f"P2P OK for all {len(s.nvml.pairs)} pairs", WARN,
                   "Disable PCIe ACS in the BIOS or boot with iommu=pt; otherwise: export NCCL_P2P_DISABLE=1")


@check("topo.acs", "topology", "ACS/IOMMU not in the P2P path", min_gpus=2, too_few="one GPU: no P2P path")
def topo_acs(s: Snapshot, ctx: CheckContext) -> Outcome:
    bad = []
    cmd = s.host.cmdline
    if cmd is not None:
        words = cmd.split()
        if ("intel_iommu=on" in words or "amd_iommu=on" in words) and "iommu=pt" not in words:
            bad.append("IOMMU in translation mode (intel_iommu/amd_iommu=on without iommu=pt)")
    if s.host.acs_enabled_bridges:
        bad.append(f"ACS source validation on {len(s.host.acs_enabled_bridges)} bridge(s): "
                   + " ".join(s.host.acs_enabled_bridges[:8]))
    fix = "Add iommu=pt to the kernel command line; disable ACS in the BIOS (or `setpci` ECAP_ACS+0x6.w=0000 per bridge)"
    if bad:
        return Outcome(WARN, bad, fix)
    if cmd is None or s.host.acs_enabled_bridges is None:
        return Outcome(UNKNOWN, ["ACS control needs root and lspci to read" if s.host.acs_enabled_bridges is None
                                 else "/proc/cmdline not read"], "Run `sudo orbitctl doctor` to read ACSCtl")
    return Outcome(PASS, ["IOMMU passthrough/off and no ACS bridges"])


@check("numa.map", "topology", "GPU to NUMA node map", min_gpus=1)
def numa_map(s: Snapshot, ctx: CheckContext) -> Outcome:
    rows = []
    for g in s.nvml.gpus:
        cpus = g.local_cpulist or g.cpu_affinity
        node = "?" if g.numa_node is None else ("none" if g.numa_node < 0 else str(g.numa_node))
        rows.append(f"{gpu_label(g)}: NUMA node {node}, CPUs {format_cpulist(cpus)}")
    if all(g.numa_node is None and not g.cpu_affinity for g in s.nvml.gpus):
        return Outcome(UNKNOWN, rows, None)
    nodes = sorted({g.numa_node for g in s.nvml.gpus if g.numa_node is not None and g.numa_node >= 0})
    return Outcome(INFO, rows, None, {"gpu_nodes": {g.index: g.numa_node for g in s.nvml.gpus}, "nodes": nodes})


def _gpu_node_cpus(s: Snapshot, g: Gpu) -> tuple[int | None, set[int]]:
    if g.numa_node is not None and g.numa_node >= 0:
        return g.numa_node, set(s.host.numa_nodes.get(str(g.numa_node), g.local_cpulist or []))
    return None, set(g.local_cpulist or g.cpu_affinity or [])


@check("numa.bind", "topology", "ranks bound to their GPU's NUMA node", min_gpus=1)
def numa_bind(s: Snapshot, ctx: CheckContext) -> Outcome:
    all_cpus = {c for cpus in s.host.numa_nodes.values() for c in cpus}
    if not s.host.numa_nodes:
        return Outcome(UNKNOWN, ["/sys/devices/system/node not read"])
    if len(s.host.numa_nodes) == 1:
        return Outcome(PASS, ["one NUMA node: nothing to bind"])
    placements = []  # (gpu, who, cpus, mems)
    for g in s.nvml.gpus:
        for p in g.processes or []:
            if p.cpus_allowed is not None and not p.own:
                placements.append((g, f"pid {p.pid}", p.cpus_allowed, p.mems_allowed))
    local_rank = s.env.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit() and s.host.process.cpus_allowed is not None:
        idx = int(local_rank)
        visible = [v.strip() for v in s.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible and idx < len(visible) and visible[idx].isdigit():
            idx = int(visible[idx])
        gpu = next((g for g in s.nvml.gpus if g.index == idx), None)
        if gpu is not None:
            placements.append((gpu, f"this process (LOCAL_RANK={local_rank})", s.host.process.cpus_allowed,
                               s.host.process.mems_allowed))
    if not placements:
        return Outcome(INFO, ["no running ranks to judge"],
                       "Bind each rank to its GPU's node: numactl --cpunodebind=N --membind=N python train.py (see numa.map)")
    wrong, unbound = [], []
    for g, who, cpus, mems in placements:
        node, node_cpus = _gpu_node_cpus(s, g)
        if not node_cpus:
            continue
        cpu_set = set(cpus)
        where = f"{who} on {gpu_label(g)} (node {node})"
        if all_cpus and cpu_set >= all_cpus:
            unbound.append(f"{where}: not bound (all {len(all_cpus)} CPUs)")
        elif not cpu_set & node_cpus:
            wrong.append(f"{where}: bound to CPUs {format_cpulist(cpus)}, none on the GPU's node")
        elif mems and node is not None and node not in mems:
            wrong.append(f"{where}: memory bound to node(s) {format_cpulist(mems)}")
    fix = "numactl --cpunodebind=N --membind=N per rank, N = the GPU's node from numa.map (torchrun: --numa-binding=node)"
    if wrong:
        return Outcome(FAIL, wrong + unbound, fix)
    if unbound:
        return Outcome(WARN, unbound, fix)
    return Outcome(PASS, [f"{len(placements)} rank(s) on their GPU's NUMA node"])
