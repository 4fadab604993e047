"""Every run measures its memory against the plan: each rank's peak per phase, next to the prediction.

    meter = PhaseMemory.for_profile(profile, device)   # before the base is built or loaded: the baseline
    with meter.phase("rollout"):
        ...
    meter.report()   # collective: {"phase_memory": {phase: {predicted_bytes, measured_bytes: [per rank]}}, ...}

On a GPU a phase's peak is ``torch.cuda.max_memory_allocated`` (reset as the phase starts) and the
device's used memory from NVML as the phase ends (context, NCCL, other processes). On the CPU it
is the rise of the process's resident set over its size before the base was built or loaded: the kernel's
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` after the allocator has given
freed pages back) at the end of the phase, minus that baseline. The CPU's exact measure costs speed (see
:data:`FAST_MMAP_THRESHOLD_BYTES`), so it runs on the first steps and every :data:`MEASURE_EVERY`-th; the peaks are
the largest of those. The prediction is ``orbitctl plan``'s peak of the same phase for this profile. A
measured/predicted ratio outside :data:`RATIO_BAND` (and more than :data:`SLACK_BYTES` apart) is a warning
that names the phase, given once each time the ratio leaves the band. A phase that ran less than the plan counts
(:class:`PhaseRun`) is reported apart (``partial_bytes``) and never compared.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from orbitctl.procmem import pin_mmap_threshold, reset_high_water, return_freed_heap, status_bytes
from orbitctl.units import MiB, gib

PHASES = ("rollout", "policy_update")
"""The phases train runs as steps of its own (the shared engine syncs no adapter: rollout reads it in place)."""
RATIO_BAND = (0.8, 1.2)
MMAP_THRESHOLD_BYTES = 1 * MiB
"""On the CPU, while a phase is measured, allocations from this size get pages of their own
(:func:`orbitctl.procmem.pin_mmap_threshold`), so the resident set a phase rises by is what it holds, as the plan counts
it, not the heap holes its freed temporaries left."""
FAST_MMAP_THRESHOLD_BYTES = 32 * MiB
"""The threshold between measured steps: glibc's own largest (with the trim threshold at twice it, as glibc's own
adjustment sets it). An allocation on pages of its own faults them in and unmaps them when freed, which on the CPU
doubled a step of the representative setting (benchmarks/train_vs_trl.py, NF4: rollout 11.4 s and update 11.8 s
pinned at 1 MiB, 5.8 s and 8.7 s in the steps between); the heap reuses its freed blocks."""
EXACT_STEPS = 2
"""On the CPU the first RL steps of a process are measured (the first pays the warm-up, the second is steady) ..."""
MEASURE_EVERY = 10
"""... and then every this many: the peaks are the largest of the measured steps."""
SLACK_BYTES = 256 * MiB
"""A difference smaller than this is not warned about whatever the ratio: on a tiny model the process's
own allocations (allocator arenas, kernels, DeepSpeed's buffers) outweigh everything the plan models."""


@dataclass
class PhaseRun:
    """One measured phase. ``full`` is cleared by a phase that ran less than the plan counts (an update that left out
    the rows without a gradient: :func:`orbitctl.rl.update.live_rows`); its peak is then kept apart
    (``partial_bytes`` in the report) and not held against the prediction."""

    full: bool = True


def _nvml_used(index: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


class PhaseMemory:
    """This rank's peak memory per phase (the largest seen over the run so far) and the plan's prediction."""

    def __init__(self, predicted: dict[str, int | None], device: str = "cpu") -> None:
        self.predicted = predicted
        self.device = device
        self.cuda = device.startswith("cuda")
        if not self.cuda:
            pin_mmap_threshold(MMAP_THRESHOLD_BYTES)  # before the base is built: its temporaries too
            return_freed_heap()  # the baseline is what is in use, like every phase's start
        self.baseline = 0 if self.cuda else (status_bytes("VmRSS") or 0)
        self.measured: dict[str, int] = {}
        self.partial: dict[str, int] = {}
        """Peaks of phases that ran less than the plan counts (:class:`PhaseRun`), never compared with it."""
        self.device_used: dict[str, int] = {}
        self.kind = "cuda_max_allocated" if self.cuda else "rss_rise"
        self._outside: set[str] = set()
        self.rounds = 0
        """RL steps reported so far (:meth:`report`)."""
        self.plan_step_s: float | None = None
        """The same plan's predicted seconds of one RL step (a rollout and its updates); None without a time model."""

    @property
    def measuring(self) -> bool:
        """Whether this RL step's phases are measured: every step on a GPU; on the CPU the first :data:`EXACT_STEPS`
        and every :data:`MEASURE_EVERY`-th, the allocator pinned for them and left fast between them."""
        return self.cuda or self.rounds < EXACT_STEPS or self.rounds % MEASURE_EVERY == 0

    @classmethod
    def for_profile(cls, profile, device: str = "cpu") -> "PhaseMemory":
        """The plan's per-phase peak for ``profile`` (None where the planner has no such phase), with its ``auto``
        dtypes as this device resolves them: the plan counts auto as bf16 (the GPU rule), where a CPU without native
        bf16 computes, caches and keeps its unquantized weights in fp32."""
        from orbitctl.kernels.cpu_dtype import resolved_dtype
        from orbitctl.plan import apply_changes, plan_profile

        autos = {key: resolved_dtype("auto", device) for key, value in
                 (("quant.compute_dtype", profile.quant.compute_dtype), ("adapter.dtype", profile.adapter.dtype))
                 if value == "auto"}
        plan = plan_profile(apply_changes(profile, autos) if autos else profile, with_advice=False)
        meter = cls({phase: plan.phase_peak_bytes.get(phase) for phase in PHASES}, device)
        timing = getattr(plan, "timing", None)
        meter.plan_step_s = float(timing.seconds) if timing is not None else None
        return meter

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the phase run inside; it yields a :class:`PhaseRun` whose ``full`` the caller clears when the phase
        ran less than the plan counts."""
        import torch

        run = PhaseRun()
        if not self.measuring:
            pin_mmap_threshold(FAST_MMAP_THRESHOLD_BYTES, trim_bytes=2 * FAST_MMAP_THRESHOLD_BYTES)
            yield run
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            pin_mmap_threshold(MMAP_THRESHOLD_BYTES)
            return_freed_heap()
            if not reset_high_water():
                self.kind = "rss_rise_lifetime"  # no resettable high-water mark: the process's peak so far
        try:
            yield run
        finally:
            if self.cuda:
                peak = int(torch.cuda.max_memory_allocated())
                used = _nvml_used(torch.cuda.current_device())
                if used is not None:
                    self.device_used[name] = max(self.device_used.get(name, 0), used)
            else:
                peak = max(0, (status_bytes("VmHWM") or status_bytes("VmRSS") or 0) - self.baseline)
            kept = self.measured if run.full else self.partial
            kept[name] = max(kept.get(name, 0), peak)

    def report(self) -> dict:
        """Collective (every rank calls it): measured per phase and rank beside the prediction, and the
        warnings of phases whose ratio just left the band."""
        from orbitctl.dist.collectives import gather_objects

        self.rounds += 1
        ranks = gather_objects({"measured": self.measured, "partial": self.partial, "device_used": self.device_used})
        phases, warnings = {}, []
        for name in PHASES:
            measured = [r["measured"].get(name) for r in ranks]
            predicted = self.predicted.get(name)
            entry = {"predicted_bytes": predicted, "measured_bytes": measured}
            if any(r["partial"].get(name) is not None for r in ranks):
                entry["partial_bytes"] = [r["partial"].get(name) for r in ranks]
            if any(r["device_used"] for r in ranks):
                entry["device_used_bytes"] = [r["device_used"].get(name) for r in ranks]
            known = [m for m in measured if m is not None]
            if predicted and known:
                entry["ratio"] = max(known) / predicted
                outside = not (RATIO_BAND[0] <= entry["ratio"] <= RATIO_BAND[1]) and \
                    abs(max(known) - predicted) > SLACK_BYTES
                if outside and name not in self._outside:
                    warnings.append(f"{name} memory measured {gib(max(known), 3)} GiB, plan predicted "
                                    f"{gib(predicted, 3)} GiB (ratio {entry['ratio']:.2f}, outside "
                                    f"{RATIO_BAND[0]}-{RATIO_BAND[1]})")
                (self._outside.add if outside else self._outside.discard)(name)
            phases[name] = entry
        return {"phase_memory": phases, "phase_memory_kind": self.kind, "memory_warnings": warnings}
