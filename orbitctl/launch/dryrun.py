"""`orbitctl train PROFILE --dry-run`: everything train would build for each rank, built from nothing.

No weights are read, no model is made, no process group or GPU is touched: the profile is
checked exactly as train checks it (the same refusals and the same accumulation rule), then each
rank's placement, the DeepSpeed config, the memory mechanics, the per-phase plan and the machine
check are worked out by the functions train itself calls. A user checks a trillion-parameter
recipe on a laptop before renting the node:

    from orbitctl.launch.dryrun import dry_run
    report = dry_run(profile)            # a DryRun; report.to_dict() is what --json prints
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orbitctl.errors import UserError


@dataclass(frozen=True)
class RankPlan:
    """What one rank would hold and do."""

    rank: int
    node: int
    local_rank: int
    device: str
    sequences_per_step: int
    """Completions this rank samples and trains on per RL step."""
    expert_group: int | None
    """The rank's expert-parallel group (None: no expert parallelism)."""
    expert_rank: int | None
    experts: list[int] | None
    """[first, last] global index of the routed experts this rank reads, of every MoE layer (None: a dense model)."""


@dataclass
class DryRun:
    """What ``orbitctl train`` would build for a profile, and what it would check first."""

    profile: str
    world_size: int
    nodes: int
    ranks: list[RankPlan]
    layout: dict[str, Any]
    accumulation: dict[str, int]
    deepspeed_config: dict[str, Any]
    memory: dict[str, Any]
    rollout: dict[str, Any]
    plan: dict[str, Any]
    machine_check: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["ranks"] = [asdict(r) for r in self.ranks]
        return doc


def dry_run(profile, *, snapshot=None) -> DryRun:
    """The run ``profile`` describes, worked out without running it. Raises UserError (exit 2) for what train
    itself would refuse before starting (an unsupported value, a batch that does not split over the ranks).
    ``snapshot`` (a doctor Snapshot) is the machine to check against; probed now when not given."""
    from orbitctl.plan import _arch, plan_profile, resolve_decode_graphs, resolve_rollout_batch
    from orbitctl.plan.layout import layout_of, owned_experts
    from orbitctl.rl.api import refuse_before_launch
    from orbitctl.rl.engine import deepspeed_config
    from orbitctl.rl.trainer import _accumulation, accumulation_warnings

    refuse_before_launch(profile)
    profile = resolve_decode_graphs(resolve_rollout_batch(profile))
    hw, mem, rl = profile.hardware, profile.memory, profile.rl
    world = profile.world_size
    gas = _accumulation(profile, world)
    arch = _arch(profile)
    layout = layout_of(profile, arch.num_experts)
    on_gpu = hw.gpu != "cpu"
    ep = mem.expert_parallel if layout.expert_parallel_on and world > 1 else 1
    if ep > 1 and arch.num_experts % ep:
        raise UserError(f"memory.expert_parallel: {arch.num_experts} routed experts do not split evenly over {ep} ranks",
                        fix=f"use an expert-parallel size that divides {arch.num_experts}")
    ranks = []
    for rank in range(world):
        local = rank % hw.gpus_per_node
        if arch.num_experts:
            held = owned_experts(rank % ep, ep, arch.num_experts)
            experts = [held.start, held.stop - 1]
        else:
            experts = None
        ranks.append(RankPlan(rank=rank, node=rank // hw.gpus_per_node, local_rank=local,
                              device=f"cuda:{local}" if on_gpu else "cpu",
                              sequences_per_step=rl.prompts_per_step * rl.group_size // world,
                              expert_group=rank // ep if ep > 1 else None, expert_rank=rank % ep if ep > 1 else None,
                              experts=experts))
    plan = plan_profile(profile)
    run_device = "cuda" if on_gpu else "cpu"
    bf16 = _adapter_dtype(profile, run_device) == "bf16"
    ds = deepspeed_config(profile, gas, bf16)
    notes = list(accumulation_warnings(gas, profile))
    return DryRun(
        profile=profile.name, world_size=world, nodes=hw.nodes, ranks=ranks,
        layout={"name": layout.name, "expert_parallel": ep, "dense_layout": layout.dense,
                "routed_experts": arch.num_experts, "routed_experts_per_rank": layout.experts_per_rank if ep > 1 else
                arch.num_experts, "zero_stage": mem.zero_stage},
        accumulation={"derived": gas, "profile": mem.gradient_accumulation_steps,
                      "micro_batch_size": mem.micro_batch_size},
        deepspeed_config=ds,
        memory=_memory_mechanics(profile, plan),
        rollout={"engine": profile.rollout.engine, "batch_size": profile.rollout_batch_size,
                 "max_new_tokens": profile.rollout.max_new_tokens, "kv_dtype": profile.rollout.kv_dtype,
                 "decode_graphs": bool(plan.timing.phases["rollout"].graph_kernels),
                 # as the builder resolves it: streamed wherever the decode is eager, on orbitctl's own rollout
                 "continuous_batching": profile.rollout.continuous_batching is not False
                 and not plan.timing.phases["rollout"].graph_kernels and profile.rollout.engine == "shared"
                 and not str(profile.data.train).startswith("env:"),
                 "compute_dtype": _adapter_dtype(profile, run_device, profile.quant.compute_dtype),
                 "adapter_dtype": _adapter_dtype(profile, run_device)},
        plan=_plan_summary(plan), machine_check=_machine_check(profile, snapshot), notes=notes)


def _adapter_dtype(profile, device_type: str, name: str | None = None) -> str:
    """``adapter.dtype`` (or ``name``) as the run's device resolves it, without importing torch."""
    from orbitctl.kernels.cpu_dtype import planned_dtype

    return planned_dtype(profile.adapter.dtype if name is None else name, device_type)


def _memory_mechanics(profile, plan) -> dict[str, Any]:
    """The memory features train builds, each with the plan's bytes for it."""
    from dataclasses import replace

    from orbitctl.plan import _arch
    from orbitctl.plan.activations import logits_peak
    from orbitctl.plan.measure import settings_for
    from orbitctl.plan.ops import fused_int4

    mem = profile.memory
    host = plan.host_components
    arch, settings = _arch(profile), settings_for(profile)
    return {
        "gradient_checkpointing": mem.gradient_checkpointing,
        "keep_frozen_outputs": mem.keep_frozen_outputs,
        "kept_frozen_output_bytes": int(_kept_frozen_bytes(arch, profile, settings)) if mem.keep_frozen_outputs else 0,
        "offload_activations": mem.offload_activations,
        "offloaded_activation_bytes_per_node": int(host.get("offloaded_activations", 0)),
        "loss_chunk_size": mem.loss_chunk_size,
        "loss_chunks_per_micro_batch": (-(-mem.micro_batch_size * mem.seq_len // mem.loss_chunk_size)
                                        if mem.loss_chunk_size else 1),
        "logits_loss_bytes": int(logits_peak(arch, settings)),
        "logits_loss_bytes_unchunked": int(logits_peak(arch, replace(settings, loss_chunk=0))),
        "attention": "flash-style (SDPA)" if mem.flash_attention else "eager (score matrix kept)",
        "zero_stage": mem.zero_stage,
        "offload_params": mem.offload_params,
        "offloaded_base_bytes_per_node": int(host.get("offloaded_base", 0)),
        "offload_optimizer": mem.offload_optimizer,
        "prefetch_layers": mem.prefetch_layers,
        "activation_peak_moment": plan.details.get("activation_peak_moment"),
        "int4_kernel": "fused" if fused_int4(profile.quant, profile.hardware.gpu) else "dequantize",
        "int4_kernel_pack_bytes": int(max((phase.get("int4_kernel_pack", 0) for phase in plan.phases.values()),
                                          default=0)),
    }


def _plan_summary(plan) -> dict[str, Any]:
    timing = plan.timing
    return {"fits": plan.fits, "verdict": plan.verdict(), "peak_phase": plan.peak_phase,
            "phase_peak_bytes": plan.phase_peak_bytes, "usable_bytes": plan.usable_bytes,
            "host_bytes": plan.host_bytes, "host_capacity_bytes": plan.host_capacity_bytes,
            "max_micro_batch": plan.max_micro_batch,
            "step_seconds": round(timing.seconds, 3) if timing is not None else None,
            "phase_seconds": ({name: round(p.seconds, 3) for name, p in timing.phases.items()}
                              if timing is not None else None)}


def _machine_check(profile, snapshot) -> dict[str, Any]:
    """The check train makes before it starts any rank, run here against this machine: what it asks for and
    whether this machine has it (a dry run reports a failure; train would stop on it with exit 2)."""
    from orbitctl.launch.fit import MACHINE_CHECKS, check_machine

    hw = profile.hardware
    needs = ("CPU ranks over gloo: nothing to check" if hw.gpu == "cpu"
             else f"{hw.gpus_per_node} x {hw.gpu} per node with the memory the plan assumes")
    try:
        fit = check_machine(profile, snapshot)
    except UserError as exc:
        return {"checks": list(MACHINE_CHECKS), "needs": needs, "passes_here": False, "message": exc.message,
                "fix": exc.fix}
    return {"checks": list(MACHINE_CHECKS), "needs": needs, "passes_here": True,
            "message": f"{fit.gpus} GPU(s) found" if hw.gpu != "cpu" else needs, "fix": None}


def _kept_frozen_bytes(arch, profile, settings) -> float:
    """The frozen matmuls' outputs ``memory.keep_frozen_outputs`` keeps for one micro-batch, every reached layer's."""
    from orbitctl.plan.activations import frozen_outputs
    from orbitctl.plan.adapters import plan_adapters

    first = plan_adapters(arch, profile.adapter).first_layer
    return sum(frozen_outputs(arch, layer, settings) for layer in arch.layers[first:]) * settings.tokens
