"""The check registry: each check is a function (Snapshot, CheckContext) -> Outcome.

A check module decorates its functions with ``@check(id, area, title)``; ``run_registered``
runs them in registration order and wraps each result in a Finding with its stable id.
``min_gpus=N`` puts the GPU guard in front of a check: with no GPU visible it answers
``no_gpu_outcome`` (SKIP, or UNKNOWN when NVML could not be asked), with fewer than N
GPUs it answers SKIP with the check's ``too_few`` line; the body runs only past the guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from orbitctl.doctor.findings import FAIL, NO_GPU_SKIP, PASS, SKIP, UNKNOWN, Finding
from orbitctl.doctor.snapshot import Gpu, Snapshot
from orbitctl.units import gib

NO_GPU = "no NVIDIA driver/GPU found"
NO_GPU_FIX = ("On a GPU machine install the NVIDIA driver, or run the container with `--gpus all` (NVIDIA container "
              "toolkit)")


@dataclass
class CheckContext:
    """What the checks know beyond the snapshot."""

    expect_gpus: int | None = None
    profile: Any = None
    """A loaded orbitctl Profile (doctor PROFILE), or None."""
    active: bool = False


@dataclass
class Outcome:
    status: str
    evidence: list[str]
    fix: str | None = None
    data: dict | None = None


CheckFn = Callable[[Snapshot, CheckContext], Outcome]


@dataclass
class Check:
    id: str
    area: str
    title: str
    fn: CheckFn
    when: str = "always"
    """always | profile (needs a PROFILE) | active (needs --active)."""
    min_gpus: int = 0
    """GPUs the body needs; fewer and the registry answers for it (see ``guard``)."""
    too_few: str = ""
    """SKIP evidence when some, but fewer than ``min_gpus``, GPUs are visible (required for min_gpus > 1)."""

    def guard(self, s: Snapshot) -> Outcome | None:
        """The Outcome that stands in for the body when the GPUs it needs are not there, else None."""
        if self.min_gpus < 1:
            return None
        if (gone := no_gpu_outcome(s)) is not None:
            return gone
        if len(s.nvml.gpus) < self.min_gpus:
            return Outcome(SKIP, [self.too_few])
        return None


REGISTRY: list[Check] = []


def check(check_id: str, area: str, title: str, when: str = "always", *, min_gpus: int = 0,
          too_few: str = "") -> Callable[[CheckFn], CheckFn]:
    if min_gpus > 1 and not too_few:
        raise ValueError(f"{check_id}: min_gpus={min_gpus} needs the too_few line it answers with")

    def register(fn: CheckFn) -> CheckFn:
        REGISTRY.append(Check(check_id, area, title, fn, when, min_gpus, too_few))
        return fn

    return register


def run_registered(snapshot: Snapshot, ctx: CheckContext) -> list[Finding]:
    findings = []
    for c in REGISTRY:
        if c.when == "profile" and ctx.profile is None or c.when == "active" and not ctx.active:
            continue
        try:
            out = c.guard(snapshot)
            if out is None:
                out = c.fn(snapshot, ctx)
        except Exception as exc:  # a check bug must not hide the other checks
            out = Outcome(UNKNOWN, [f"check crashed: {type(exc).__name__}: {exc}"])
        findings.append(Finding(id=c.id, area=c.area, status=out.status, title=c.title,
                                evidence=out.evidence, fix=out.fix, data=out.data or {}))
    return findings


def no_gpu_outcome(s: Snapshot) -> Outcome | None:
    """SKIP when no GPU is visible (marked :data:`NO_GPU_SKIP`; ``env.nvml`` alone carries NVML's detail),
    UNKNOWN when NVML could not be asked; None when GPUs are there."""
    nv = s.nvml
    if nv.status == "ok" and nv.gpus:
        return None
    if nv.status in ("no_library", "no_driver") or (nv.status == "ok" and not nv.gpus):
        return Outcome(SKIP, [NO_GPU], data={"skip_reason": NO_GPU_SKIP})
    return Outcome(UNKNOWN, [f"NVML could not be read: {nv.detail or nv.status}"],
                   "Run as a user allowed to open /dev/nvidia* (or root), e.g. `sudo orbitctl doctor`")


def field_unknown(gpus: list[Gpu], name: str, what: str) -> Outcome:
    """SKIP when every GPU says 'not supported', else UNKNOWN naming why."""
    reasons = {g.errors.get(name, "not reported") for g in gpus}
    if reasons == {"not_supported"}:
        return Outcome(SKIP, [f"{what}: not supported on these GPUs"])
    return Outcome(UNKNOWN, [f"{what}: {', '.join(sorted(reasons))}"],
                   "Run as root to read it" if "no_permission" in reasons else None)


def size_gib(n: int | float | None) -> str:
    """Bytes as the checks show them: '79.1 GiB', or '?' when not known."""
    return "?" if n is None else f"{gib(n, 1)} GiB"


def gpu_label(g: Gpu) -> str:
    return f"GPU {g.index}" + (f" ({g.bus_id})" if g.bus_id else "")


def fail_if(bad: list[str], good: str, status: str = FAIL, fix: str | None = None) -> Outcome:
    return Outcome(status, bad, fix) if bad else Outcome(PASS, [good])
