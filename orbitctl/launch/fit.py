"""Does this machine have what the profile asks for? Asked before any data, model or process group.

A CPU profile (``hardware.gpu: cpu``) runs its ranks as CPU processes over gloo and needs nothing
more. A GPU profile needs ``hardware.gpus_per_node`` GPUs of its model with the memory the plan
assumed: the same probes and profile checks as ``orbitctl doctor --profile`` (NVML), judged here
as a refusal (exit 2) that names the shortfall and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbitctl.errors import UserError

MACHINE_CHECKS = ("gpu.count", "prof.gpu", "prof.mem")
"""The doctor checks that decide whether the ranks can start at all."""


@dataclass
class MachineFit:
    """What the launcher needs to know about this machine."""

    gpus: int = 0
    numa_nodes: list[int | None] = field(default_factory=list)
    """Each GPU's NUMA node as sysfs reports it (None or -1: the platform gives none)."""

    @property
    def numa_known(self) -> bool:
        return bool(self.numa_nodes) and all(n is not None and n >= 0 for n in self.numa_nodes)


def check_machine(profile, snapshot=None) -> MachineFit:
    """The machine's GPUs when they are what ``profile`` needs; a UserError naming what is missing otherwise.
    ``snapshot`` (a doctor Snapshot) is probed now when not given."""
    hw = profile.hardware
    if hw.gpu == "cpu":
        return MachineFit()
    from orbitctl.doctor import api as doctor

    snap = snapshot if snapshot is not None else doctor.take_snapshot(probe_torch=False)
    findings = doctor.run_checks(snap, expect_gpus=hw.gpus_per_node, profile=profile)
    failed = [f for f in findings if f.id in MACHINE_CHECKS and f.status in ("FAIL", "UNKNOWN")
              and not (f.id == "gpu.count" and len(snap.nvml.gpus) >= hw.gpus_per_node)]
    if failed:
        evidence = "; ".join(dict.fromkeys(f.evidence[0] for f in failed if f.evidence))
        raise UserError(f"hardware: the profile needs {hw.gpus_per_node} x {hw.gpu} on this node, and here {evidence}",
                        fix=f"run it on a node with {hw.gpus_per_node} {hw.gpu} GPUs, or set hardware.gpu and "
                            f"hardware.gpus_per_node to this machine's (`orbitctl doctor --profile PROFILE` shows what is "
                            f"here; `orbitctl plan` then says whether the run still fits)")
    gpus = snap.nvml.gpus[: hw.gpus_per_node]
    return MachineFit(len(gpus), [g.numa_node for g in gpus])
