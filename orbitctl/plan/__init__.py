"""`orbitctl plan`: does a profile fit in HBM and host RAM, and what to change if not.

    from orbitctl.plan import plan_profile
    plan = plan_profile(load_profile("profiles/kimi-k2_grpo_int4_8xb200.yaml"))
    plan.fits, plan.peak_bytes, plan.max_micro_batch, plan.advice
    plan.communication.terms, plan.layouts     # bytes one RL step sends per GPU; the layouts compared
    plan.timing.seconds, plan.timing.phases    # predicted seconds of one RL step by phase; plan.nodes: 1 vs 2 nodes

Imports no torch: every number comes from the ArchSpec and the formulas in docs/plan.md.
``measure_profile`` (the FakeTensorMode calibration) imports torch lazily.
"""

from __future__ import annotations

import itertools
from typing import Any

from orbitctl.errors import ProfileError, UserError
from orbitctl.plan.advice import advise, compare_layouts, compare_nodes, layout_notes, max_micro_batch
from orbitctl.plan.budget import evaluate, prepare
from orbitctl.plan.comm import COMM_TERMS, completions_per_gpu
from orbitctl.plan.profile_arch import profile_arch as _arch
from orbitctl.plan.timing import seconds_text
from orbitctl.plan.result import COMPONENTS, PHASES, Advice, MemoryPlan

__all__ = ["plan_profile", "plan_sweep", "apply_changes", "measure_profile", "compare_profile", "resolve_rollout_batch",
           "auto_rollout_batch", "MemoryPlan", "Advice", "COMPONENTS", "COMM_TERMS", "PHASES"]


def apply_changes(profile, change: dict[str, Any]):
    """A copy of ``profile`` with dotted keys set, validated like a --set override."""
    from orbitctl.profile.loader import validate_profile

    data = profile.model_dump()
    for key, value in change.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise UserError(f"{key}: unknown profile key", fix="use a dotted key such as memory.micro_batch_size")
            node = node[part]
        if leaf not in node:
            raise UserError(f"{key}: unknown profile key", fix="use a dotted key such as memory.micro_batch_size")
        node[leaf] = value
    return validate_profile(data, f"profile '{profile.name}'")


def _searched(profile, inputs, gpu_memory_bytes: int | None) -> MemoryPlan:
    """One plan with its largest fitting micro-batch."""
    plan = evaluate(profile, inputs, gpu_memory_bytes=gpu_memory_bytes)
    plan.max_micro_batch = max_micro_batch(
        lambda mb: evaluate(profile, inputs, gpu_memory_bytes=gpu_memory_bytes, micro_batch=mb).fits)
    return plan


def auto_rollout_batch(profile, *, gpu_memory_bytes: int | None = None) -> int:
    """The sequences per GPU ``rollout.batch_size: auto`` decodes at once: the most whose rollout phase fits the
    usable memory, at most the step's sequences per GPU (more would decode nothing), at least 1.

    Every rollout term that grows with the batch (KV cache, the prefill's working set and all-to-all
    buffers, sampling logits, the routing record) is linear in it, so two plans give the line and a
    third checks its answer; a batch that does not fit then shrinks until it does."""
    arch = _arch(profile)

    def rollout(n: int) -> tuple[int, int]:
        other = apply_changes(profile, {"rollout.batch_size": n})
        plan = evaluate(other, prepare(other, arch), gpu_memory_bytes=gpu_memory_bytes)
        return sum(plan.phases["rollout"].values()), plan.usable_bytes

    cap = completions_per_gpu(profile)
    one, usable = rollout(1)
    per = rollout(2)[0] - one
    n = cap if per <= 0 else min(cap, max(1, int((usable - one) // per) + 1))
    while n > 1 and rollout(n)[0] > usable:
        n = max(1, n * 9 // 10 if n > 10 else n - 1)
    return n


def resolve_rollout_batch(profile, *, gpu_memory_bytes: int | None = None):
    """``profile`` with ``rollout.batch_size: auto`` replaced by :func:`auto_rollout_batch`'s number (the profile
    itself otherwise): what train, eval and the plan decode with."""
    if profile.rollout.batch_size != "auto":
        return profile
    return apply_changes(profile, {"rollout.batch_size": auto_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes)})


def graphed_rollout_seconds(profile, *, gpu_memory_bytes: int | None = None) -> tuple[float, float]:
    """The rollout seconds the plan predicts for ``profile`` (its batch resolved) with the decode replayed from CUDA
    graphs and eager: ``(graphed, eager)``, equal where graphs do not apply (a CPU, fp8 KV, an engine)."""
    arch = _arch(profile)
    seconds = []
    for graphs in (True, False):
        other = apply_changes(profile, {"rollout.decode_graphs": graphs})
        seconds.append(evaluate(other, prepare(other, arch), gpu_memory_bytes=gpu_memory_bytes)
                       .timing.phases["rollout"].seconds)
    return seconds[0], seconds[1]


def resolve_decode_graphs(profile, *, gpu_memory_bytes: int | None = None):
    """``profile`` with ``rollout.decode_graphs: auto`` replaced by true where the plan predicts the graphed rollout
    faster than the eager one, else false (the profile itself otherwise): graphs save launches and attend over the
    static cache's whole length, so a decode already bound by HBM at short contexts can be faster eager. What train,
    eval and the plan decode with. rollout.continuous_batching true resolves it to false (a graph replays fixed rows)."""
    if profile.rollout.decode_graphs != "auto":
        return profile
    if profile.rollout.continuous_batching is True:
        return apply_changes(profile, {"rollout.decode_graphs": False})
    graphed, eager = graphed_rollout_seconds(resolve_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes),
                                             gpu_memory_bytes=gpu_memory_bytes)
    return apply_changes(profile, {"rollout.decode_graphs": graphed < eager})


def plan_profile(profile, *, gpu_memory_bytes: int | None = None, with_advice: bool = True) -> MemoryPlan:
    """Plan a validated Profile; ``gpu_memory_bytes`` overrides the per-GPU capacity (e.g. free memory now).

    With advice it also compares the base layouts (expert parallelism x dense layout) by peak and
    by the bytes one RL step sends: ``plan.layouts``. ``rollout.batch_size: auto`` is planned at the number it
    resolves to (:func:`resolve_rollout_batch`)."""
    auto = profile.rollout.batch_size == "auto"
    graphs_auto = profile.rollout.decode_graphs == "auto"
    given = profile
    profile = resolve_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes)
    if graphs_auto and profile.rollout.continuous_batching is True:  # streamed rows: eager decode
        profile, graphs_auto = apply_changes(profile, {"rollout.decode_graphs": False}), False
    if graphs_auto:
        graphed, eager = graphed_rollout_seconds(profile, gpu_memory_bytes=gpu_memory_bytes)
        profile = apply_changes(profile, {"rollout.decode_graphs": graphed < eager})
    arch = _arch(profile)
    plan = _searched(profile, prepare(profile, arch), gpu_memory_bytes)
    if auto:
        seqs = profile.rollout.batch_size
        plan.details["rollout_batch_size_auto"] = seqs
        plan.notes.append(f"rollout.batch_size auto: {seqs} sequences decoded at once per GPU (the most the rollout "
                          f"phase fits, at most the step's {completions_per_gpu(profile)})")
    if graphs_auto and graphed != eager:
        plan.details["decode_graphs_auto"] = graphed < eager
        plan.notes.append(f"rollout.decode_graphs auto: {'CUDA graphs' if graphed < eager else 'eager decode'} (rollout "
                          f"{seconds_text(graphed)} with graphs, {seconds_text(eager)} eager)")
    if with_advice:
        def replan(change: dict[str, Any], search: bool = False) -> MemoryPlan | None:
            """The plan a user gets from the profile as given plus ``--set`` ``change``: its ``auto`` values
            resolved again for the changed run (an FP8 cache fits more sequences)."""
            try:
                other = apply_changes(given if auto or graphs_auto else profile, change)
                if auto or graphs_auto:
                    other = _resolved(other, gpu_memory_bytes)
            except (ProfileError, UserError):
                return None
            inputs = prepare(other, _arch(other))
            if search:
                return _searched(other, inputs, gpu_memory_bytes)
            return evaluate(other, inputs, gpu_memory_bytes=gpu_memory_bytes)

        plan.advice = advise(profile, plan, arch, replan) + _rollout_batch_advice(profile, plan, gpu_memory_bytes, auto)
        plan.layouts = compare_layouts(profile, plan, arch, lambda change: replan(change, search=True))
        plan.notes += layout_notes(plan.layouts)
        plan.nodes = compare_nodes(profile, plan, lambda change: replan(change))
    return plan


def _resolved(profile, gpu_memory_bytes: int | None):
    """``profile`` with rollout.batch_size and rollout.decode_graphs ``auto`` resolved, as :func:`plan_profile` does."""
    profile = resolve_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes)
    return resolve_decode_graphs(profile, gpu_memory_bytes=gpu_memory_bytes)


def _rollout_batch_advice(profile, plan: MemoryPlan, gpu_memory_bytes: int | None, auto: bool) -> list[Advice]:
    """Where the rollout phase has room for more sequences than the profile decodes at once: ``rollout.batch_size:
    auto``, with the rollout time it predicts (fewer rounds of the same decode steps)."""
    if auto or not plan.fits:
        return []
    now = profile.rollout_batch_size
    room = auto_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes)
    if room <= now:
        return []
    other = plan_profile(apply_changes(profile, {"rollout.batch_size": room}), gpu_memory_bytes=gpu_memory_bytes,
                         with_advice=False)
    if not other.fits:
        return []
    before, after = plan.timing.phases["rollout"].seconds, other.timing.phases["rollout"].seconds
    text = (f"decode {room} sequences at once per GPU instead of {now} (rollout.batch_size: auto, what the rollout "
            f"phase has room for): rollout {seconds_text(before)} -> {seconds_text(after)} per step; peak "
            f"{other.peak_bytes / 2**30:.1f} GiB (fits)")
    return [Advice({"rollout.batch_size": "auto"}, text, other.peak_bytes, True)]


def plan_sweep(profile, sweeps: list[tuple[str, list[Any]]], *, gpu_memory_bytes: int | None = None) -> list[dict]:
    """Plan every combination of the swept values; one row per combination."""
    rows = []
    keys = [k for k, _ in sweeps]
    for values in itertools.product(*(v for _, v in sweeps)):
        change = dict(zip(keys, values))
        plan = plan_profile(apply_changes(profile, change), gpu_memory_bytes=gpu_memory_bytes, with_advice=False)
        rows.append({"values": change, "peak_bytes": plan.peak_bytes, "peak_phase": plan.peak_phase,
                     "utilization": round(plan.utilization, 4), "fits": plan.fits,
                     "max_micro_batch": plan.max_micro_batch, "phase_peak_bytes": plan.phase_peak_bytes,
                     "step_seconds": plan.timing.seconds, "gpu_hours": plan.timing.gpu_hours,
                     "cost_per_step": plan.timing.cost_per_step,
                     "phase_seconds": {k: p.seconds for k, p in plan.timing.phases.items()}})
    return rows


def compare_profile(profile, axes: list[str], *, gpu_memory_bytes: int | None = None) -> dict:
    """``plan --compare``: the run in other layouts (orbitctl.plan.compare), ranked by predicted step time."""
    from orbitctl.plan.compare import compare

    def replan(change: dict[str, Any]) -> MemoryPlan | None:
        try:
            other = apply_changes(profile, change) if change else profile
        except (ProfileError, UserError):
            return None
        return plan_profile(other, gpu_memory_bytes=gpu_memory_bytes, with_advice=False)

    return compare(profile, _arch(profile), axes, replan)


def measure_profile(profile, **kwargs):
    """Calibrate the activation and logit terms under FakeTensorMode (imports torch)."""
    from orbitctl.plan.measure import measure_profile as _measure

    return _measure(profile, **kwargs)
