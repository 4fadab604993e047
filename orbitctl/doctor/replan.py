"""Run the memory planner for the memory this machine (or a failed run) really had, or for a proposed fix.

The planner lives in orbitctl.plan: ``plan_profile(profile, gpu_memory_bytes=...)`` returns
peak_bytes, usable_bytes, fits, max_micro_batch and advice (change, text, peak_bytes, fits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orbitctl.plan.result import set_values
from orbitctl.units import GiB, gib


@dataclass
class Replan:
    """The planner's verdict for one memory size, with its advice as ready-to-paste lines."""

    gpu_memory_bytes: int
    available: bool = True
    error: str | None = None
    fits: bool | None = None
    peak_bytes: int | None = None
    usable_bytes: int | None = None
    max_micro_batch: int | None = None
    advice: list[str] = field(default_factory=list)
    """e.g. 'set memory.micro_batch_size=4: planned peak 121 GiB of 126 GiB usable'."""
    set_flags: list[str] = field(default_factory=list)
    """The first fitting change as --set flags, e.g. ['memory.micro_batch_size=4']."""

    def summary(self) -> str:
        if not self.available:
            return f"memory plan not available: {self.error}"
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"planned peak {_gib(self.peak_bytes)} of {_gib(self.usable_bytes)} usable "
                f"(GPU memory {_gib(self.gpu_memory_bytes)}): {verdict}")


def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{gib(n, 0 if n >= 10 * GiB else 1)} GiB"


def format_change(change: dict[str, Any]) -> str:
    return ", ".join(set_values(change))


def replan_change(profile: Any, change: dict[str, Any]) -> Replan:
    """``profile`` with ``change`` applied (dotted keys), planned for its own GPUs: the verdict on a proposed fix.

    Never raises: a change the profile refuses comes back with available=False and the reason."""
    try:
        from orbitctl.plan import apply_changes

        changed = apply_changes(profile, change)
    except Exception as exc:  # a refused change is part of the verdict, like the planner's own errors
        return Replan(gpu_memory_bytes=profile.hardware.memory_bytes(), available=False,
                      error=f"change refused: {getattr(exc, 'message', None) or exc}")
    return replan(changed, changed.hardware.memory_bytes())


def replan(profile: Any, gpu_memory_bytes: int) -> Replan:
    """Plan ``profile`` for ``gpu_memory_bytes`` per GPU; never raises (planner missing -> available=False)."""
    out = Replan(gpu_memory_bytes=int(gpu_memory_bytes))
    try:
        from orbitctl.plan import plan_profile
    except ImportError as exc:
        out.available, out.error = False, f"orbitctl.plan.plan_profile not importable ({exc})"
        return out
    try:
        plan = plan_profile(profile, gpu_memory_bytes=int(gpu_memory_bytes))
    except Exception as exc:  # the planner's own input errors become part of the verdict
        out.available, out.error = False, f"planner failed: {getattr(exc, 'message', None) or exc}"
        return out
    out.fits = bool(getattr(plan, "fits", False))
    out.peak_bytes = getattr(plan, "peak_bytes", None)
    out.usable_bytes = getattr(plan, "usable_bytes", None)
    out.max_micro_batch = getattr(plan, "max_micro_batch", None)
    fitting, other = [], []
    # advice only matters when the run does not fit this memory (a fitting plan's advice grows the batch)
    for item in (getattr(plan, "advice", None) or []) if not out.fits else []:
        change = dict(getattr(item, "change", None) or {})
        peak = getattr(item, "peak_bytes", None)
        line = (f"set {format_change(change)}: planned peak {_gib(peak)} of {_gib(out.usable_bytes)} usable"
                if change else str(getattr(item, "text", "")))
        (fitting if getattr(item, "fits", False) else other).append((line, change))
    current_mb = getattr(getattr(profile, "memory", None), "micro_batch_size", None)
    if (not fitting and out.max_micro_batch and current_mb and 0 < out.max_micro_batch < current_mb):
        fitting.append((f"set memory.micro_batch_size={out.max_micro_batch}: the largest micro-batch that fits "
                        f"{_gib(out.usable_bytes)} usable", {"memory.micro_batch_size": out.max_micro_batch}))
    # changes that make it fit, when there are any; otherwise the partial ones
    out.advice = [line for line, _ in (fitting or other)]
    if fitting:
        out.set_flags = set_values(fitting[0][1])
    return out
