"""PROFILE checks: the profile's hardware against this machine, and the plan for its free memory."""

from __future__ import annotations

from orbitctl.doctor.findings import FAIL, PASS, SKIP, UNKNOWN, WARN
from orbitctl.doctor.registry import CheckContext, Outcome, check, no_gpu_outcome, size_gib
from orbitctl.doctor.replan import replan
from orbitctl.doctor.snapshot import Snapshot
from orbitctl.units import gib


def _profile_gpu(ctx: CheckContext):
    from orbitctl.profile.gpus import resolve_gpu

    return resolve_gpu(ctx.profile.hardware.gpu)


def _not_here(s: Snapshot, ctx: CheckContext) -> Outcome | None:
    """SKIP for a CPU profile, then the no-GPU outcome; None when the profile's GPUs can be judged here."""
    if _profile_gpu(ctx).name == "cpu":
        return Outcome(SKIP, ["profile runs on CPU"])
    return no_gpu_outcome(s)


def _used_gpus(s: Snapshot, ctx: CheckContext):
    return s.nvml.gpus[: ctx.profile.hardware.gpus_per_node]


@check("prof.gpu", "GPU", "profile's GPU model is this machine's", when="profile")
def prof_gpu(s: Snapshot, ctx: CheckContext) -> Outcome:
    from orbitctl.profile.gpus import match_gpu_name

    spec = _profile_gpu(ctx)
    if spec.name == "cpu":
        return Outcome(SKIP, ["profile runs on CPU (hardware.gpu: cpu)"])
    if (gone := no_gpu_outcome(s)) is not None:
        gone.status = FAIL if gone.status == SKIP else gone.status
        gone.evidence.insert(0, f"profile wants {ctx.profile.hardware.gpus_per_node} x {spec.marketing}")
        return gone
    names = sorted({g.name or "?" for g in s.nvml.gpus})
    here = {match_gpu_name(n) for n in names}
    ev = [f"profile: hardware.gpu={spec.name} ({spec.marketing}); machine: {', '.join(names)}"]
    if here == {spec}:
        return Outcome(PASS, ev)
    known = next((g for g in here if g is not None), None)
    fix = f"orbitctl doctor PROFILE --set hardware.gpu={known.name}" if known else \
        "Set hardware.gpu to this machine's model and hardware.gpu_memory_gib to its memory"
    smaller = known is None or known.visible_bytes < spec.visible_bytes
    return Outcome(FAIL if smaller else WARN, ev + ["the plan was made for another GPU"], fix)


@check("prof.mem", "memory", "GPU memory the profile assumes is there", when="profile")
def prof_mem(s: Snapshot, ctx: CheckContext) -> Outcome:
    if (skip := _not_here(s, ctx)) is not None:
        return skip
    want = ctx.profile.hardware.memory_bytes()
    gpus = [g for g in _used_gpus(s, ctx) if g.memory_total_bytes]
    if not gpus:
        return Outcome(UNKNOWN, ["GPU memory not reported"])
    least = min(gpus, key=lambda g: g.memory_total_bytes)
    ev = [f"profile assumes {size_gib(want)} per GPU; smallest here GPU {least.index}: {size_gib(least.memory_total_bytes)}"]
    if least.memory_total_bytes < 0.98 * want:
        return Outcome(FAIL, ev, f"orbitctl plan PROFILE --set hardware.gpu_memory_gib={gib(least.memory_total_bytes, 0)}")
    return Outcome(PASS, ev)


@check("prof.fit", "memory", "the run fits here, now (plan for real free memory)", when="profile")
def prof_fit(s: Snapshot, ctx: CheckContext) -> Outcome:
    if (skip := _not_here(s, ctx)) is not None:
        return skip
    gpus = [g for g in _used_gpus(s, ctx) if g.memory_free_bytes is not None]
    if not gpus:
        return Outcome(UNKNOWN, ["free GPU memory not reported"])
    least = min(gpus, key=lambda g: g.memory_free_bytes)
    verdict = replan(ctx.profile, least.memory_free_bytes)
    ev = [f"least free: GPU {least.index} {size_gib(least.memory_free_bytes)}", verdict.summary()]
    data = {"gpu_memory_bytes": verdict.gpu_memory_bytes, "peak_bytes": verdict.peak_bytes,
            "usable_bytes": verdict.usable_bytes, "fits": verdict.fits, "advice": verdict.advice}
    if not verdict.available:
        return Outcome(UNKNOWN, ev, None, data)
    if verdict.fits:
        return Outcome(PASS, ev, None, data)
    fix = "; ".join(verdict.advice[:3]) or "Lower memory.micro_batch_size, or enable offload (memory.offload_optimizer: cpu)"
    return Outcome(FAIL, ev, fix, data)

