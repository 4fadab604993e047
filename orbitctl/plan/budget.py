"""Profile + ArchSpec -> bytes per GPU for every component in every phase, and host RAM.

Phases: ``policy_update`` (forward + backward + optimizer step of one micro-batch),
``rollout`` (decoding the rollout batch with a KV cache), ``adapter_sync`` (the full
adapter gathered for a separate engine or a checkpoint). Components resident in every phase
(context, communicators, base shard, adapter states) appear in each.
"""

from __future__ import annotations

from dataclasses import dataclass

from orbitctl.arch.spec import ArchSpec
from orbitctl.plan.activations import ActivationSettings, train_activations
from orbitctl.plan.adapters import AdapterPlan, plan_adapters
from orbitctl.plan.result import MemoryPlan
from orbitctl.plan.states import model_states
from orbitctl.plan.storage import BaseStorage, base_storage, quant_format
from orbitctl.units import GiB

CUDA_CONTEXT = int(0.5 * GiB)
"""Context + kernels with lazy module loading (1.3 GB measured without it)."""
NCCL_PER_COMMUNICATOR = 1 * GiB
PROCESS_HOST_BYTES = 3 * GiB
"""Host RSS of one training rank: Python, torch, CUDA libraries."""
OVERLAP_COMM_FACTOR = 4.5
VLLM_PREFILL_TOKENS = 8192
"""A separate engine's chunked-prefill budget (max_num_batched_tokens)."""


@dataclass(frozen=True)
class Inputs:
    """What one evaluation needs, computed once per profile and reused by the max-batch search."""

    arch: ArchSpec
    storage: BaseStorage
    adapters: AdapterPlan


def prepare(profile, arch: ArchSpec) -> Inputs:
    return Inputs(arch, base_storage(arch, profile.quant, profile.model.dtype), plan_adapters(arch, profile.adapter))


def gpu_capacity(profile, override: int | None = None) -> int:
    return int(override) if override is not None else profile.hardware.memory_bytes()


def _gather(profile, storage: BaseStorage) -> float:
    """ZeRO-3's largest window of gathered units in execution order (current + prefetch)."""
    mem = profile.memory
    if mem.zero_stage != 3 and mem.offload_params != "cpu":
        return 0.0
    ep = mem.expert_parallel
    units = [storage.embedding_bytes]
    units += [total - experts + experts / ep for total, experts in zip(storage.layer_bytes, storage.layer_expert_bytes)]
    units.append(storage.lm_head_bytes)
    window = 1 + mem.prefetch_layers
    return max(sum(units[i:i + window]) for i in range(len(units)))


def _kv_cache(profile, arch: ArchSpec, mb: int) -> tuple[float, int]:
    """KV bytes per GPU of the rollout batch, and the sequences decoded per GPU."""
    ro = profile.rollout
    seqs = ro.batch_size or mb * profile.rl.group_size
    kv_bytes = 1 if ro.kv_dtype == "fp8" else 2
    tp = ro.engine_tp if ro.engine == "separate" else 1
    per_token = arch.num_layers * arch.kv_elements_per_token_layer() * kv_bytes
    if arch.attention == "mla":
        replication = tp  # one latent 'head': every TP rank keeps the whole latent
    else:
        replication = tp / min(tp, arch.num_kv_heads)
    context = max(profile.memory.seq_len, ro.max_new_tokens)
    return seqs * context * per_token * replication, seqs


def _rollout_working(profile, arch: ArchSpec, seqs: int) -> float:
    """No-grad prefill of the prompts (one layer's intermediates) plus sampling logits."""
    prompt = max(1, profile.memory.seq_len - profile.rollout.max_new_tokens)
    tokens = seqs * prompt
    if profile.rollout.engine == "separate":
        tokens = min(tokens, VLLM_PREFILL_TOKENS * profile.rollout.engine_tp)
    h = arch.hidden_size
    width = max(arch.intermediate_size if arch.moe_layers < arch.num_layers else 0,
                arch.experts_per_token * arch.moe_intermediate_size + arch.shared_intermediate_size)
    per_token = 4 * h + 6 * width + 4 * arch.num_heads * max(arch.head_dim, arch.v_head_dim or 0)
    return float(tokens * per_token + seqs * arch.vocab_size * 10)


def evaluate(profile, inp: Inputs, *, gpu_memory_bytes: int | None = None,
             micro_batch: int | None = None) -> MemoryPlan:
    """One full plan (no max-batch search, no advice)."""
    arch, storage, ad = inp.arch, inp.storage, inp.adapters
    mem, hw, ro = profile.memory, profile.hardware, profile.rollout
    mb = micro_batch or mem.micro_batch_size
    world, gpn, nodes = profile.world_size, hw.gpus_per_node, hw.nodes
    on_gpu = hw.gpu != "cpu"
    notes: list[str] = []

    # ---- fixed ------------------------------------------------------------------------------
    communicators = (1 if world > 1 else 0) + (1 if mem.expert_parallel > 1 else 0) + (
        1 if ro.engine == "separate" and ro.engine_tp > 1 else 0)
    fixed = {
        "cuda_context": CUDA_CONTEXT if on_gpu else 0,
        "nccl": communicators * NCCL_PER_COMMUNICATOR if on_gpu else 0,
        "zero_buckets": int(OVERLAP_COMM_FACTOR * 2 * min(arch.hidden_size ** 2, ad.trainable_params))
        if (mem.zero_stage > 0 and world > 1) else 0,
    }

    # ---- frozen base ------------------------------------------------------------------------
    shard = world if mem.zero_stage == 3 else 1
    offloaded = mem.offload_params == "cpu"
    base_gpu = 0.0 if offloaded else storage.sharded_bytes / shard + storage.unshardable_bytes
    fmt = quant_format(profile.quant)
    if not fmt.shardable and mem.zero_stage == 3:
        notes.append("quant.storage_dtype uint8: ZeRO-3 cannot partition bitsandbytes' packed uint8 weights; "
                     "set quant.storage_dtype: bf16 to shard them")
    if storage.replicated_bytes and fmt.shardable:
        notes.append("bitsandbytes quant_state (absmax) is not a parameter: every rank keeps all of it")
    gather = _gather(profile, storage)
    dequant = float(storage.largest_dequant_bytes)
    if ad.adapts_routed_experts:
        notes.append("adapters on routed experts: PEFT builds every expert's bf16 weight per MoE layer "
                     f"({storage.layer_expert_bf16_bytes / GiB:.1f} GiB); prefer adapter.targets: attention+shared")
    resident_base = {"base_weights": int(base_gpu),
                     "quant_state_replicated": 0 if offloaded else int(storage.replicated_bytes)}

    # ---- adapter states ---------------------------------------------------------------------
    states = model_states(
        ad.trainable_params, ad.largest_layer_params, zero_stage=mem.zero_stage, gpus_per_node=gpn, nodes=nodes,
        offload_optimizer=mem.offload_optimizer == "cpu", offload_params=mem.offload_params == "cpu",
        persistent=ad.persistent_params, weight_bytes=2 if profile.adapter.dtype == "bf16" else 4)
    resident_states = {"adapter_weights": int(states.weights), "adapter_grads": int(states.grads),
                       "optimizer_master": int(states.master), "optimizer_adam": int(states.adam)}

    # ---- activations ------------------------------------------------------------------------
    st = ActivationSettings(
        tokens=mb * mem.seq_len, seq_len=mem.seq_len, checkpointing=mem.gradient_checkpointing,
        offload=mem.offload_activations == "cpu", flash=mem.flash_attention, dropout=profile.adapter.dropout > 0,
        adapter_bytes=2 if profile.adapter.dtype == "bf16" else 4, loss_chunk=mem.loss_chunk_size)
    acts = train_activations(arch, ad, st)

    # ---- rollout ----------------------------------------------------------------------------
    kv, seqs = _kv_cache(profile, arch, mb)
    rollout_work = _rollout_working(profile, arch, seqs)
    separate = ro.engine == "separate"
    engine = storage.total_bytes / ro.engine_tp if separate else 0.0
    if not separate and mem.zero_stage == 3 and world > 1:
        notes.append("rollout on the ZeRO-3 shard gathers every layer for every decoded token: memory-safe but slow")

    if arch.mtp_layers:
        notes.append(f"{arch.mtp_layers} next-token-prediction (MTP) layer(s), {arch.mtp_params / 1e9:.1f} B parameters, "
                     "are not loaded for RL and not planned")
    resident = {**fixed, **resident_base, **resident_states}
    asleep = separate and ro.engine_sleep
    engine_during_update = {} if (not separate or asleep) else {"engine_weights": int(engine),
                                                                "rollout_kv_cache": int(kv)}
    phases = {
        "policy_update": {**resident, "zero3_gather": int(gather), "dequant_transient": int(dequant),
                          "adapter_gathered": int(states.gathered), "activations": int(acts.activations),
                          "logits_loss": int(acts.logits), **engine_during_update},
        "rollout": {**resident, **({"engine_weights": int(engine)} if separate else
                                   {"zero3_gather": int(gather), "dequant_transient": int(dequant)}),
                    "rollout_kv_cache": int(kv), "rollout_activations": int(rollout_work)},
        "adapter_sync": {**resident, "adapter_sync": int(2 * ad.trainable_params),
                         **({"engine_weights": int(engine)} if separate else {})},
    }
    if separate and not asleep:
        phases["adapter_sync"]["rollout_kv_cache"] = int(kv)
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))

    # ---- host RAM per node --------------------------------------------------------------------
    host = {
        "processes": PROCESS_HOST_BYTES * gpn,
        "offloaded_activations": int(acts.saved_boundaries_host * gpn),
        "offloaded_optimizer": int(states.host),
        "offloaded_base": int((storage.sharded_bytes + storage.unshardable_bytes) / nodes
                              + storage.replicated_bytes * gpn) if offloaded else 0,
        "sleeping_engine": int(engine * gpn) if asleep else 0,
        "load_path": int(4 * arch.largest_layer_params),
    }
    capacity = gpu_capacity(profile, gpu_memory_bytes)
    return MemoryPlan(
        phases=phases, peak_phase=peak_phase, usable_bytes=int(capacity * mem.max_hbm_utilization),
        gpu_memory_bytes=capacity, host_bytes=sum(host.values()), host_components=host,
        host_capacity_bytes=int(hw.host_ram_gib * GiB), params_total=arch.params_total,
        params_active=arch.params_active, params_trainable=ad.trainable_params, max_micro_batch=0, notes=notes,
        details={"arch": arch.name, "micro_batch_size": mb, "tokens_per_micro_batch": st.tokens,
                 "activation_peak_moment": acts.moment, "quant_bits_per_weight": round(fmt.bits, 4),
                 "base_total_bytes": int(storage.total_bytes), "adapter_rank": ad.rank,
                 "rollout_sequences_per_gpu": seqs, "mtp_params_excluded": arch.mtp_params,
                 "adapts_routed_experts": ad.adapts_routed_experts},
    )
