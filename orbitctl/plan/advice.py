"""Largest micro-batch that fits, and ordered advice: each change re-planned with its peak.

Candidates come in the order an operator would try them (cheapest to the run first):
micro-batch, checkpointing, chunked loss, activation offload, INT4, ZeRO-3, expert
parallelism, prefetch depth, engine sleep/sharing, KV dtype, adapter targets, optimizer
offload, shorter sequences, more GPUs. Fitting suggestions come first.

The layout comparison re-plans the frozen base's placements (expert parallelism 1 or the
widest P, dense part sharded or replicated): peak, largest micro-batch and the bytes one RL
step sends, so the fitting layout that moves the least stands out.
"""

from __future__ import annotations

from typing import Any, Callable

from orbitctl.plan.comm import bytes_text
from orbitctl.plan.layout import widest_expert_parallel
from orbitctl.plan.result import Advice, MemoryPlan, set_values
from orbitctl.units import GiB

MAX_MICRO_BATCH = 4096


def max_micro_batch(fits_at: Callable[[int], bool]) -> int:
    """Largest mb in [1, 4096] with fits_at(mb); 0 when even 1 does not fit (peak grows with mb)."""
    if not fits_at(1):
        return 0
    low, high = 1, 2
    while high <= MAX_MICRO_BATCH and fits_at(high):
        low, high = high, high * 2
    high = min(high, MAX_MICRO_BATCH + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits_at(mid) else (low, mid)
    return low


def _candidates(profile, plan: MemoryPlan, arch) -> list[tuple[dict[str, Any], str]]:
    mem, quant, ro, hw = profile.memory, profile.quant, profile.rollout, profile.hardware
    out: list[tuple[dict[str, Any], str]] = []
    mb, best = mem.micro_batch_size, plan.max_micro_batch
    per_rank = mb * mem.gradient_accumulation_steps  # sequences per rank and optimizer step: kept by these changes
    if plan.fits and best > mb:
        size = same_batch_micro_batch(per_rank, best)
        if size > mb:
            out.append(({"memory.micro_batch_size": size, "memory.gradient_accumulation_steps": per_rank // size},
                        f"raise the micro-batch to {size} (the largest that fits and divides the {per_rank} sequences "
                        f"per rank and step), accumulate {per_rank // size} (same global batch)"))
        return out
    if best and best < mb:
        size = same_batch_micro_batch(per_rank, best)
        out.append(({"memory.micro_batch_size": size, "memory.gradient_accumulation_steps": per_rank // size},
                    f"lower the micro-batch to {size} and accumulate {per_rank // size} steps (same global batch)"))
    elif mb > 1:
        out.append(({"memory.micro_batch_size": 1, "memory.gradient_accumulation_steps": per_rank},
                    f"lower the micro-batch to 1 and accumulate {per_rank} steps (same global batch)"))
    if not mem.gradient_checkpointing:
        out.append(({"memory.gradient_checkpointing": True}, "turn on gradient checkpointing (keep one input per layer)"))
    if mem.loss_chunk_size == 0 and mem.seq_len * mb > 1024:
        out.append(({"memory.loss_chunk_size": 1024}, "compute lm_head + loss in chunks of 1024 tokens"))
    if mem.offload_activations == "none":
        change = {"memory.offload_activations": "cpu"}
        if not mem.gradient_checkpointing:
            change = {"memory.gradient_checkpointing": True, **change}
        out.append((change, "offload the layer checkpoints to host RAM"))
    if quant.format in ("fp8", "none"):
        out.append(({"quant.format": "int4", "quant.group_size": 128 if quant.group_size not in (32, 64, 128) else quant.group_size},
                    f"store the base as INT4 instead of {quant.format}"))
    if mem.zero_stage < 3:
        what = "dense base (the routed experts stay expert-parallel)" if mem.expert_parallel > 1 and arch.is_moe \
            else "base"
        out.append(({"memory.zero_stage": 3}, f"ZeRO-3: shard the frozen {what} across GPUs, gathered layer by layer"))
    if arch.is_moe and mem.expert_parallel == 1:
        ep = widest_expert_parallel(arch.num_experts, hw.gpus_per_node)
        if ep > 1:
            out.append(({"memory.expert_parallel": ep},
                        f"expert parallelism {ep}: each GPU keeps {arch.num_experts // ep} of the {arch.num_experts} "
                        "routed experts of every MoE layer and never gathers them (tokens travel by all-to-all)"))
    if mem.prefetch_layers > 0 and mem.zero_stage == 3:
        out.append(({"memory.prefetch_layers": 0}, "no ZeRO-3 prefetch (one gathered layer at a time; slower)"))
    if ro.engine == "separate" and not ro.engine_sleep:
        out.append(({"rollout.engine_sleep": True}, "let the inference engine sleep during the update"))
    if ro.engine == "separate":
        out.append(({"rollout.engine": "shared"}, "roll out on the trainer's own weights (no second copy)"))
    if ro.kv_dtype == "bf16" and plan.peak_phase == "rollout":
        graphs = ro.decode_graphs is not False and ro.engine == "shared" and _nvidia(hw.gpu)
        out.append(({"rollout.kv_dtype": "fp8"}, "FP8 KV cache for rollout" + (
            " (its decode runs eagerly: CUDA graphs replay a bf16 cache only)" if graphs else "")))
    if plan.details["routed_expert_adapters"]["via_targets"]:
        out.append(({"adapter.targets": "attention+shared"}, "adapt attention and shared MLPs, not routed experts"))
    if mem.offload_optimizer == "none" and mem.zero_stage >= 1:
        out.append(({"memory.offload_optimizer": "cpu"}, "offload the fp32 master and Adam states to host RAM"))
    if mem.seq_len >= 1024:
        out.append(({"memory.seq_len": mem.seq_len // 2}, f"shorter sequences: {mem.seq_len // 2} tokens"))
    if hw.gpus_per_node < 8:
        out.append(({"hardware.gpus_per_node": 8}, "use 8 GPUs per node"))
    else:
        out.append(({"hardware.nodes": hw.nodes * 2}, f"use {hw.nodes * 2} nodes"))
    return out


def same_batch_micro_batch(per_rank: int, most: int) -> int:
    """The largest micro-batch of at most ``most`` that divides ``per_rank`` (micro-batch x accumulation): the
    global batch stays exactly what it was."""
    return max(d for d in range(1, min(per_rank, most) + 1) if per_rank % d == 0)


def _nvidia(gpu: str) -> bool:
    from orbitctl.profile.gpus import resolve_gpu

    return resolve_gpu(gpu).vendor == "nvidia"


def advise(profile, plan: MemoryPlan, arch, replan: Callable[[dict[str, Any]], MemoryPlan | None]) -> list[Advice]:
    """Re-plan every candidate change; keep those that fit or lower the peak, fitting ones first."""
    if plan.fits and not plan.tight and plan.max_micro_batch <= profile.memory.micro_batch_size:
        return []
    advice: list[Advice] = []
    candidates = _candidates(profile, plan, arch)
    for change, text in candidates:
        other = replan(change)
        if other is None:
            continue
        # advice that leaves the peak where it is changes nothing the plan can show: not given (raising the
        # micro-batch is the exception: it spends the room the plan found)
        raises = change.get("memory.micro_batch_size", 0) > profile.memory.micro_batch_size
        if other.peak_bytes < plan.peak_bytes or (not plan.fits and other.fits) or (raises and other.fits):
            advice.append(_advice(change, text, other))
    if not plan.fits and not any(a.fits for a in advice):
        combined = _combine(candidates, plan, replan)
        if combined is not None:
            advice.append(combined)
    order = {id(a): i for i, a in enumerate(advice)}
    return sorted(advice, key=lambda a: (not a.fits, order[id(a)] if a.fits else a.peak_bytes))


def _advice(change: dict[str, Any], text: str, other: MemoryPlan) -> Advice:
    return Advice(change, f"{text}: peak {other.peak_bytes / GiB:.1f} GiB ({'fits' if other.fits else 'still over'})",
                  other.peak_bytes, other.fits)


def _combine(candidates, plan: MemoryPlan, replan) -> Advice | None:
    """No single change fits: take changes in order, keeping each that lowers the peak, until it fits."""
    change: dict[str, Any] = {}
    texts: list[str] = []
    best = plan
    for step, text in candidates:
        trial = replan({**change, **step})
        if trial is not None and trial.peak_bytes < best.peak_bytes:
            change, best = {**change, **step}, trial
            texts.append(text)
            if trial.fits:
                break
    if len(texts) < 2:
        return None
    return _advice(change, "together: " + "; ".join(texts), best)


def _layout_changes(profile, arch) -> list[dict[str, Any]]:
    """Changes to each base layout: (EP 1 | widest P) x (dense sharded | replicated), the profile's own first."""
    mem, hw = profile.memory, profile.hardware
    eps = sorted({1, widest_expert_parallel(arch.num_experts, hw.gpus_per_node)})
    changes: list[dict[str, Any]] = [{}]
    for ep in eps:
        for stage in (3, min(mem.zero_stage, 2)):
            change: dict[str, Any] = {"memory.expert_parallel": ep, "memory.zero_stage": stage}
            if mem.dense_layout != "auto":
                change["memory.dense_layout"] = "sharded" if stage == 3 else "replicated"
            if stage < 3:  # a replicated base has no ZeRO-3 partitions to offload
                change["memory.offload_params"] = "none"
            current = {"memory.expert_parallel": mem.expert_parallel, "memory.zero_stage": mem.zero_stage,
                       "memory.dense_layout": mem.dense_layout, "memory.offload_params": mem.offload_params}
            change = {k: v for k, v in change.items() if current[k] != v}
            if change not in changes:
                changes.append(change)
    return changes


def compare_layouts(profile, plan: MemoryPlan, arch, replan: Callable[[dict[str, Any]], MemoryPlan | None]) -> list[dict]:
    """One row per base layout: its change (``--set`` values), peak, fit, largest micro-batch and the bytes
    one RL step sends per GPU and its predicted seconds (timing.py, at the profile's micro-batch);
    ``best`` marks the layout that sends the least among those that run (largest micro-batch > 0),
    ``fastest`` the one with the shortest predicted step. Empty on one GPU, or when no other layout is a valid profile."""
    if profile.world_size == 1:
        return []
    rows = []
    for change in _layout_changes(profile, arch):
        other = plan if not change else replan(change)
        if other is None:  # the change is not a valid profile (e.g. parameter offload needs ZeRO-3)
            continue
        comm = other.communication.to_dict()
        rows.append({"layout": comm["layout"], "expert_parallel": other.details["expert_parallel"],
                     "dense_layout": other.details["dense_layout"], "change": change, "set": set_values(change),
                     "current": not change, "peak_bytes": other.peak_bytes, "fits": other.fits,
                     "max_micro_batch": other.max_micro_batch, "bytes": comm["by_kind"],
                     "total_bytes": comm["total_bytes"], "link_seconds": comm["link_seconds"],
                     "step_seconds": other.timing.seconds, "rollout_seconds": other.timing.phases["rollout"].seconds,
                     "update_seconds": other.timing.phases["policy_update"].seconds,
                     "bound": {k: p.bound for k, p in other.timing.phases.items()}, "best": False, "fastest": False})
    if len(rows) < 2:
        return []
    runnable = [r for r in rows if r["max_micro_batch"] > 0]
    if runnable:
        min(runnable, key=lambda r: r["total_bytes"])["best"] = True
        min(runnable, key=lambda r: r["step_seconds"])["fastest"] = True
    return rows


def layout_notes(rows: list[dict]) -> list[str]:
    """A note when another layout that can run sends less than half the profile's own bytes per RL step."""
    current = next((r for r in rows if r["current"]), None)
    best = next((r for r in rows if r["best"]), None)
    if current is None or best is None or best is current or 2 * best["total_bytes"] >= current["total_bytes"]:
        return []
    if best["fits"]:
        where = f"fits (peak {best['peak_bytes'] / GiB:.1f} GiB)"
    else:
        where = f"fits with memory.micro_batch_size <= {best['max_micro_batch']}"
    return [f"layout {best['layout']} sends {bytes_text(best['total_bytes'])} per GPU per RL step instead of "
            f"{bytes_text(current['total_bytes'])} and {where}: --set " + " --set ".join(best["set"])]


def compare_nodes(profile, plan: MemoryPlan, replan: Callable[[dict[str, Any]], MemoryPlan | None]) -> list[dict]:
    """The profile's run on its own node(s) and on twice the nodes over the NIC (same global batch): predicted
    seconds per RL step by phase, GPU-hours and tokens/s. Empty on one GPU or when the profile spans nodes."""
    from orbitctl.plan.timing import nodes_change

    change = nodes_change(profile)
    other = replan(change) if change else None
    if other is None:
        return []
    rows = []
    for p, c in ((plan, {}), (other, change)):
        t = p.timing.to_dict()
        rows.append({"nodes": t["nodes"], "world": t["world"], "change": c, "set": set_values(c),
                     "fits": p.fits, "seconds": t["seconds"], "gpu_hours": t["gpu_hours"],
                     "phase_seconds": {k: v["seconds"] for k, v in t["phases"].items()},
                     "bound": {k: v["bound"] for k, v in t["phases"].items()},
                     "rollout_tokens_per_s": t["rollout_tokens_per_s"], "update_tokens_per_s": t["update_tokens_per_s"]})
    return rows
