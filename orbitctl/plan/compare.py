"""`plan --compare`: the same run in other layouts, ranked by predicted step time at equal batch.

Three axes, each a set of ``--set`` changes re-planned like advice (memory and time):

- ``layout`` (MoE, more than one GPU): every layer ZeRO-3-gathered (expert parallelism 1, the base
  sharded) against expert parallelism at the widest P with the dense part replicated;
- ``engine``: rollout on the trainer's own weights (``rollout.engine: shared``) against a separate
  engine (``separate``): it decodes from its own copy split over ``rollout.engine_tp`` GPUs without
  the trainer's ZeRO-3 gathers or all-to-alls, with its own all-reduces, and receives the whole adapter
  once per step;
- ``nodes`` (more than one GPU): the run on one node against two over the NIC (a run that already
  spans nodes: against one node of the same GPUs per node).

The global batch (prompts x group size per step, micro-batch) stays; only the placement changes.
"""

from __future__ import annotations

from typing import Any, Callable

from orbitctl.errors import UserError
from orbitctl.plan.layout import widest_expert_parallel
from orbitctl.plan.result import set_values

AXES = ("layout", "engine", "nodes")
ENGINE_ASSUMPTION = ("separate engine: decodes from its own copy of the base split over rollout.engine_tp GPUs, "
                     "without the trainer's ZeRO-3 gathers and all-to-alls, with its tensor-parallel all-reduces, "
                     "and receives the whole adapter once per step")


def parse_axes(text: str) -> list[str]:
    """'all' or a comma list of layout, engine, nodes (exit 2 on anything else)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or names == ["all"]:
        return ["all"]
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise UserError(f"--compare {text}: unknown axis {', '.join(unknown)}",
                        fix=f"use all or a comma list of {', '.join(AXES)}")
    return list(dict.fromkeys(names))


def _options(profile, arch, axis: str) -> list[tuple[str, dict[str, Any]]] | str:
    """(label, change) of each option on ``axis``, the profile's own included; or why the axis does not apply."""
    mem, hw = profile.memory, profile.hardware
    if axis == "layout":
        if not arch.is_moe:
            return f"{arch.name} is dense: no experts to place by expert parallelism"
        ep = widest_expert_parallel(arch.num_experts, hw.gpus_per_node)
        if profile.world_size == 1 or ep == 1:
            return "one GPU per node: nothing to shard or split"
        zero3 = {"memory.expert_parallel": 1, "memory.zero_stage": 3}
        if mem.dense_layout != "auto":
            zero3["memory.dense_layout"] = "sharded"
        split = {"memory.expert_parallel": ep, "memory.zero_stage": min(mem.zero_stage, 2),
                 "memory.offload_params": "none"}
        if mem.dense_layout != "auto":
            split["memory.dense_layout"] = "replicated"
        return [("ZeRO-3 gathers, EP 1", zero3), (f"EP {ep}, replicated", split)]
    if axis == "engine":
        return [("shared engine", {"rollout.engine": "shared"}), ("separate", {"rollout.engine": "separate"})]
    if profile.world_size == 1:
        return "one GPU: no second node to spread it over"
    if hw.nodes == 1:
        return [("1 node", {}), ("2 nodes", {"hardware.nodes": 2})]
    return [("1 node", {"hardware.nodes": 1}), (f"{hw.nodes} nodes", {})]


def _own(profile, change: dict[str, Any]) -> dict[str, Any]:
    """The part of ``change`` that differs from the profile."""
    out = {}
    for key, value in change.items():
        node = profile
        for part in key.split("."):
            node = getattr(node, part)
        if node != value:
            out[key] = value
    return out


def compare(profile, arch, axes: list[str], replan: Callable[[dict[str, Any]], Any]) -> dict:
    """Rows per axis, fastest first: each option's predicted seconds per RL step by phase, GPU-hours, cost, fit.
    A named axis that does not apply is refused (UserError, exit 2); 'all' takes those that apply."""
    wanted = list(AXES) if axes == ["all"] else axes
    found = {axis: _options(profile, arch, axis) for axis in wanted}
    refused = {axis: why for axis, why in found.items() if isinstance(why, str)}
    if refused and axes != ["all"]:
        raise UserError("--compare: " + "; ".join(f"{axis} does not apply ({why})" for axis, why in refused.items()),
                        fix=f"drop {', '.join(refused)} from --compare")
    rows: list[dict] = []
    for axis, options in found.items():
        if isinstance(options, str):
            continue
        group = []
        for label, change in options:
            change = _own(profile, change)
            plan = replan(change)
            if plan is None:
                continue
            t = plan.timing
            group.append({"axis": axis, "option": label, "change": change, "set": set_values(change),
                          "current": not change, "fits": plan.fits, "peak_bytes": plan.peak_bytes,
                          "seconds": t.seconds, "phase_seconds": {k: p.seconds for k, p in t.phases.items()},
                          "bound": {k: p.bound for k, p in t.phases.items()}, "world": t.world, "nodes": t.nodes,
                          "gpu_hours": t.gpu_hours, "cost_per_step": t.cost_per_step,
                          "rollout_tokens_per_s": t.phases["rollout"].tokens_per_s})
        group.sort(key=lambda r: r["seconds"])
        own = next((r for r in group if r["current"]), None)
        for rank, row in enumerate(group, 1):
            row["rank"] = rank
            row["vs_current"] = row["seconds"] / own["seconds"] if own and own["seconds"] else None
        rows += group
    notes = [ENGINE_ASSUMPTION] if "engine" in found else []
    notes += [f"{axis}: not compared, {why}" for axis, why in refused.items()]
    return {"axes": [a for a in found if a not in refused], "rows": rows, "notes": notes}
