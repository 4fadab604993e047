"""Profile + ArchSpec -> bytes per GPU for every component in every phase, and host RAM.

Phases: ``policy_update`` (forward + backward + optimizer step of one micro-batch),
``rollout`` (decoding the rollout batch with a KV cache), ``adapter_sync`` (the full
adapter gathered for a separate engine or a checkpoint). Components resident in every phase
(context, communicators, base shard, routed experts, adapter states) appear in each. The
placement of the base (expert parallelism, dense layout) is ``layout.py``'s; the bytes one RL
step sends are ``comm.py``'s and the seconds it takes ``timing.py``'s; both ride along in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from orbitctl.arch.spec import ArchSpec
from orbitctl.plan.activations import ActivationSettings, train_activations
from orbitctl.plan.adapters import AdapterPlan, plan_adapters, routed_expert_adapters
from orbitctl.plan.comm import (all_to_all_buffers, bytes_text, communication, completions_per_gpu,
                                compute_dtype_bytes, decoded_tokens, prompt_tokens, rollout_batch)
from orbitctl.plan.layout import Layout, gather_units, gather_window, host_base, layout_of, resident_base
from orbitctl.plan.memo import Same, Values
from orbitctl.plan.ops import fused_int4
from orbitctl.plan.result import MemoryPlan
from orbitctl.plan.states import model_states
from orbitctl.plan.timing import step_time
from orbitctl.plan.storage import BaseStorage, base_storage, quant_format
from orbitctl.units import GiB, MiB

CUDA_CONTEXT = int(0.5 * GiB)
"""Context + kernels with lazy module loading (1.3 GB measured without it)."""
NCCL_PER_COMMUNICATOR = 1 * GiB
PROCESS_HOST_BYTES = 3 * GiB
"""Host RSS of one training rank: Python, torch, CUDA libraries."""
CPU_RANK_RUNTIME = int(0.25 * GiB)
"""What a CPU rank's resident set gains on top of its tensors from the moment before the model is built (the
baseline train measures from): the Python modules that building the model imports (transformers' model code and
PEFT, 0.16 GiB measured with transformers 5.24 / PEFT 0.21), the modules' Python objects, the DeepSpeed engine,
gloo, the OpenMP pool and oneDNN's JIT kernels for the matmul shapes a step runs. The CPU rank's counterpart of
``cuda_context``; measured, not derived (docs/plan.md)."""
CPU_MATMUL_KERNEL_BYTES = int(0.6 * MiB)
"""What one bf16 matmul shape costs a CPU rank whose bf16 matmuls run on oneDNN (a CPU with native bf16): oneDNN's
primitive cache and torch's ideep cache each keep the shape's JIT kernel, 0.32 and 0.26 MiB measured whatever the
weight's size (torch 2.13, AVX512-BF16), one entry per distinct (rows, in, out), up to 1024 entries each. fp32
matmuls run on MKL, which keeps none; on a CPU without native bf16, bf16 matmuls are emulated and keep none either."""
CPU_MATMUL_ROW_COUNTS = 14
"""The row counts each matmul weight shape meets over a run: the prefill's width, the decode batch as its rows finish
and leave it, the update's widths and the backward's forms. Measured on profiles/smollm2-135m-cpu.yaml in bf16: 127
distinct bf16 matmuls over its 10 weight shapes by step 8 (rollout and update), more with the held-out evaluation's
generate; the resident set's rise between the first and the eleventh step's rollout followed them (0.6 MiB each)."""
INT4_WORKSPACE_BYTES = 4 + 4
"""Per element of the largest INT4 matrix, the CPU dequantization workspace's int32 codes and float32 values
(orbitctl.model.quant_linear.int4_workspace); the result in the compute dtype comes on top unless it is fp32."""
FP8_DEQUANT_FP32_BYTES = 4 + 4 + 4
"""Per element of the largest FP8 matrix, the fp32 tensors one plain-torch dequantization holds at once."""
OVERLAP_COMM_FACTOR = 4.5
VLLM_PREFILL_TOKENS = 8192
"""A separate engine's chunked-prefill budget (max_num_batched_tokens)."""


INT4_KERNEL_PACK_BITS = 4
"""Per weight in the fused INT4 kernel's own layout (orbitctl.kernels.int4_kernel.Int4Pack), plus a bf16 (scale, zero)
pair per group."""


def kernel_pack_bytes(storage: BaseStorage, layout: Layout, group_size: int, experts_packed: bool = True) -> float:
    """Bytes per rank of the fused INT4 kernel's copies (``quant.kernel``: a rank repacks every INT4 weight it
    holds whole, next to the checkpoint's form the backward dequantizes): all of them, or under ZeRO-3, which
    partitions the parameters, only the expert-parallel experts (buffers outside ZeRO). ``experts_packed`` False:
    a GPU, whose routed experts run grouped from their own storage (or dequantize) and are never repacked."""
    stored_per_weight = (4 + 16 / group_size) / 8  # the checkpoint's int32 words and bf16 scales
    experts = storage.expert_sharded_bytes / stored_per_weight
    dense = storage.quantized_params - experts
    held = 0.0 if layout.sharded else dense
    if experts_packed and layout.expert_parallel_on:
        held += experts * layout.expert_share
    elif experts_packed and not layout.sharded:
        held += experts
    return held * (INT4_KERNEL_PACK_BITS / 8 + 4 / group_size)


@dataclass(frozen=True)
class Inputs:
    """What one evaluation needs, computed once per profile and reused by the max-batch search."""

    arch: ArchSpec
    storage: BaseStorage
    adapters: AdapterPlan


def prepare(profile, arch: ArchSpec) -> Inputs:
    """The Inputs of ``profile`` on ``arch``, one per architecture and quant, model dtype and adapter values: the
    re-plans of the advice, the layouts and the node count mostly change other sections and share them."""
    # the loader builds every weight it does not quantize (embeddings, norms, a skipped lm_head) in the compute
    # dtype, whatever the checkpoint's; auto (resolved by the run, bf16 here) keeps the model's dtype
    compute = profile.quant.compute_dtype
    return _inputs(Same(arch), Values(profile.quant), profile.model.dtype if compute == "auto" else compute,
                   Values(profile.adapter))


@lru_cache(maxsize=32)
def _inputs(arch_key: Same, quant: Values, model_dtype: str, adapter: Values) -> Inputs:
    arch = arch_key.obj
    return Inputs(arch, base_storage(arch, quant.section, model_dtype), plan_adapters(arch, adapter.section))


def gpu_capacity(profile, override: int | None = None) -> int:
    return int(override) if override is not None else profile.hardware.memory_bytes()


def matmul_shapes(arch: ArchSpec, adapters: AdapterPlan) -> int:
    """Distinct (out, in) shapes of the matmuls a step runs: the decoder's linear weights (the routed experts' once),
    the output layer, and the adapters' factors (LoRA: in -> r and r -> out of every adapted weight; the bottleneck
    adapter: h -> r and r -> h)."""
    linear = list(arch.linear_weights())
    shapes = {w.shape[-2:] for _, w in linear} | {(arch.vocab_size, arch.hidden_size)}
    r = adapters.rank
    if adapters.kind == "bottleneck":
        shapes |= {(r, arch.hidden_size), (arch.hidden_size, r)}
    else:
        for i, w in linear:
            if adapters.adapted_in(i, w.name):
                shapes |= {(r, w.shape[-1]), (w.shape[-2], r)}
    return len(shapes)


def cpu_matmul_kernels(profile, arch: ArchSpec, adapters: AdapterPlan) -> float:
    """Bytes a CPU rank computing in bf16 keeps of oneDNN's and ideep's per-shape kernels (0 on a GPU and in fp32):
    :func:`matmul_shapes` x :data:`CPU_MATMUL_ROW_COUNTS` kernels of :data:`CPU_MATMUL_KERNEL_BYTES`, at most the
    caches' 1024 entries each."""
    if profile.hardware.gpu != "cpu" or profile.quant.compute_dtype not in ("bf16", "auto"):  # auto: bf16 here
        return 0.0
    return float(min(matmul_shapes(arch, adapters) * CPU_MATMUL_ROW_COUNTS, 1024) * CPU_MATMUL_KERNEL_BYTES)


def _kv_cache(profile, arch: ArchSpec, mb: int) -> tuple[float, int]:
    """KV bytes per GPU of the rollout, and the sequences decoded at once per GPU. An environment's episodes keep their
    caches from one turn to the next (:func:`orbitctl.rl.multiturn.play`): every episode of the rank's step holds
    one, not only the batch being decoded (a separate engine, and router replay, read whole contexts instead)."""
    ro = profile.rollout
    seqs = rollout_batch(profile, mb)
    held = seqs
    if ro.max_turns > 1 and ro.engine != "separate" and not (profile.rl.router_replay and arch.is_moe):
        held = max(seqs, profile.rl.prompts_per_step * profile.rl.group_size // profile.world_size)
    tp = ro.engine_tp if ro.engine == "separate" else 1
    per_token = arch.num_layers * arch.kv_bytes_per_token_layer(ro.kv_dtype)
    if ro.kv_dtype == "bf16":  # the model's own cache, in the compute dtype (fp32 on a CPU without native bf16)
        per_token *= compute_dtype_bytes(profile) / 2
    if arch.attention == "mla":
        replication = tp  # one latent 'head': every TP rank keeps the whole latent
    else:
        replication = tp / min(tp, arch.num_kv_heads)
    context = max(profile.memory.seq_len, decoded_tokens(profile))
    return held * context * per_token * replication, seqs


SAMPLE_FP32_BYTES = 4 + 4 + 4
"""Per vocabulary entry of a decoded sequence, what sampling holds in fp32 beside the logits
(:meth:`orbitctl.model.policy.Policy.sample`): the temperature-scaled logits, their log-softmax (the sampled
token's log-prob) and the probabilities drawn from."""
KEYED_DRAW_BYTES = 8 + 8
"""The keyed draw's float64 copy of those probabilities and its cumulative sum (:mod:`orbitctl.model.draws`),
made where the probabilities are on a CPU rank; a GPU rank makes the copy on the device and sums on the host."""


def sampling_bytes(profile, arch: ArchSpec, seqs: int) -> float:
    """What a decode step's sampling holds over the vocabulary for ``seqs`` sequences: the output layer's ``[seqs,
    V]`` in the compute dtype and :data:`SAMPLE_FP32_BYTES` + :data:`KEYED_DRAW_BYTES` per entry (the kept infer
    distribution, written in place step by step, is :func:`kept_dist_bytes`'s)."""
    on_cpu = profile.hardware.gpu == "cpu"
    per_entry = compute_dtype_bytes(profile) + SAMPLE_FP32_BYTES + (KEYED_DRAW_BYTES if on_cpu else 8)
    return float(seqs * arch.vocab_size * per_entry)


def _rollout_working(profile, arch: ArchSpec, seqs: int) -> float:
    """No-grad prefill of the prompts (one layer's intermediates) plus a decode step's sampling
    (:func:`sampling_bytes`)."""
    tokens = seqs * prompt_tokens(profile)
    if profile.rollout.engine == "separate":
        tokens = min(tokens, VLLM_PREFILL_TOKENS * profile.rollout.engine_tp)
    h = arch.hidden_size
    width = max(arch.intermediate_size if arch.moe_layers < arch.num_layers else 0,
                arch.experts_per_token * arch.moe_intermediate_size + arch.shared_intermediate_size)
    per_token = 4 * h + 6 * width + 4 * arch.num_heads * max(arch.head_dim, arch.v_head_dim or 0)
    return float(tokens * per_token) + sampling_bytes(profile, arch, seqs)


def completion_positions(profile) -> int:
    """Positions per sequence the train path runs the output layer on: the completion's and the one before it
    (:meth:`orbitctl.model.policy.Policy.completion_logits` asks for ``logits_to_keep``); a multi-turn completion
    holds the environment's replies too, which seq_len counts with the prompt, so all of seq_len there."""
    if profile.rollout.max_turns > 1:
        return profile.memory.seq_len
    return min(profile.memory.seq_len, decoded_tokens(profile) + 1)


KEPT_DIST_BUDGET_BYTES = 256 * 2**20
"""The largest full infer distribution (rollout batch x max_new_tokens x V in fp32) the trainer keeps from the rollout
for the align loss's full KL (:mod:`orbitctl.rl.trainer`); above it, and in an environment's episodes, the align
loss takes the sampled-token k3 estimate and nothing over the vocabulary is kept."""
ENTROPY_FP32_BYTES = 4
"""Per vocabulary entry of a completion position, what the unchunked loss holds at its forward peak beyond the three
fp32 copies ``logits_peak`` counts: the entropy metric's exp, product and masked product beside the kept log-softmax
(:func:`orbitctl.distances.entropy`) are one copy more than the backward's gradient and input gradient."""
KL_SAVED_BYTES = 4 + 4
"""Per vocabulary entry of a completion position, what the full KL against the kept infer distribution saves for its
backward (:func:`orbitctl.rl.losses.kl_full`): the train probabilities and the log-ratio, fp32."""


def kept_dist_bytes(profile, arch: ArchSpec) -> float:
    """Bytes per completion of the infer distribution the rollout keeps for the full KL (0 when it keeps none):
    max_new_tokens x V in fp32, kept when the align loss is a KL, the rollout batch's stays within
    :data:`KEPT_DIST_BUDGET_BYTES` and the data are prompts (not an environment's episodes)."""
    per_completion = 4.0 * profile.rollout.max_new_tokens * arch.vocab_size
    kept = (profile.rl.align_loss.active and not profile.data.train.startswith("env:")
            and rollout_batch(profile, profile.memory.micro_batch_size) * per_completion <= KEPT_DIST_BUDGET_BYTES)
    return per_completion if kept else 0.0


def _loss_vocab_terms(profile, arch: ArchSpec, mb: int, dist: float) -> float:
    """The update's bytes over the vocabulary beside ``logits_loss``: the step's kept infer distribution (every
    completion of this rank, in the rollout batch), the micro-batch's copy of its rows, what the full KL saves and
    the entropy metric's temporaries (a chunked loss computes both a chunk at a time and copies rows per chunk)."""
    chunk = profile.memory.loss_chunk_size
    positions = mb * profile.rollout.max_new_tokens
    if chunk:
        positions = min(chunk, positions)
    held = (completions_per_gpu(profile) + (0 if chunk else mb)) * dist
    return held + positions * arch.vocab_size * (ENTROPY_FP32_BYTES + (KL_SAVED_BYTES if dist else 0))


ROUTE_INDEX_BYTES = 8
"""A recorded expert index on the device: top-k's int64, as the router tape keeps it."""
ROUTE_HOST_BYTES = 2
"""A recorded expert index between rollout and update, on the host (int16)."""


def routing_record(arch: ArchSpec, tokens: int, index_bytes: int = ROUTE_INDEX_BYTES) -> float:
    """Bytes of the routing of ``tokens`` tokens: k expert indices per MoE layer each (0 on a dense model).
    :mod:`orbitctl.model.router_replay` records it on the infer path and replays or compares it on the train path."""
    return float(tokens * arch.moe_layers * arch.experts_per_token * index_bytes)


def _layout_notes(arch: ArchSpec, layout: Layout, storage: BaseStorage) -> list[str]:
    """What expert parallelism does here, or why it does nothing."""
    p = layout.expert_parallel
    if p == 1:
        return []
    if not arch.is_moe:
        return [f"memory.expert_parallel: {p} on a model without routed experts: nothing to split"]
    notes = []
    if arch.num_experts % p:
        notes.append(f"{arch.num_experts} routed experts over {p} ranks: up to {layout.experts_per_rank} per rank")
    notes.append(f"expert parallelism {p}: each GPU holds {layout.experts_per_rank} of the {arch.num_experts} routed "
                 f"experts of every MoE layer ({storage.expert_bytes * layout.expert_share / GiB:.1f} GiB), never "
                 "gathered; tokens reach their experts by all-to-all")
    return notes


def evaluate(profile, inp: Inputs, *, gpu_memory_bytes: int | None = None,
             micro_batch: int | None = None) -> MemoryPlan:
    """One full plan (no max-batch search, no advice)."""
    arch, storage, ad = inp.arch, inp.storage, inp.adapters
    mem, hw, ro = profile.memory, profile.hardware, profile.rollout
    mb = micro_batch or mem.micro_batch_size
    world, gpn, nodes = profile.world_size, hw.gpus_per_node, hw.nodes
    on_gpu = hw.gpu != "cpu"
    notes: list[str] = []

    layout = layout_of(profile, arch.num_experts)

    # ---- fixed ------------------------------------------------------------------------------
    communicators = (1 if world > 1 else 0) + (1 if layout.expert_parallel_on else 0) + (
        1 if ro.engine == "separate" and ro.engine_tp > 1 else 0)
    fixed = {
        "cuda_context": CUDA_CONTEXT if on_gpu else 0,
        "cpu_runtime": 0 if on_gpu else CPU_RANK_RUNTIME,
        "cpu_matmul_kernels": int(cpu_matmul_kernels(profile, arch, ad)),
        "nccl": communicators * NCCL_PER_COMMUNICATOR if on_gpu else 0,
        "zero_buckets": int(OVERLAP_COMM_FACTOR * 2 * min(arch.hidden_size ** 2, ad.trainable_params))
        if (mem.zero_stage > 0 and world > 1) else 0,
    }

    # ---- frozen base ------------------------------------------------------------------------
    fmt = quant_format(profile.quant)
    if not fmt.shardable and layout.sharded:
        notes.append("quant.storage_dtype uint8: ZeRO-3 cannot partition bitsandbytes' packed uint8 weights; "
                     "set quant.storage_dtype: bf16 to shard them")
    if storage.replicated_bytes and fmt.shardable:
        notes.append("bitsandbytes quant_state (absmax) is not a parameter: every rank keeps all of it")
    notes += _layout_notes(arch, layout, storage)
    gather = gather_window(gather_units(storage, layout), mem.prefetch_layers)
    cdt = compute_dtype_bytes(profile)
    # INT4 on the CPU: one workspace per rank, kept between matmuls (resident); elsewhere a fresh bf16 weight per matmul
    workspace = not on_gpu and fmt.name == "int4"
    largest = storage.largest_dequant_bytes // 2  # elements of the largest quantized matrix
    fixed["dequant_workspace"] = largest * (INT4_WORKSPACE_BYTES + (cdt if cdt != 4 else 0)) if workspace else 0
    dequant = 0.0 if workspace else float(storage.largest_dequant_bytes)
    if fmt.name == "fp8":
        # orbitctl.codec.formats.dequantize_fp8_blocks: the codes as fp32, the block scales spread to every element
        # and their product (the result itself when the compute dtype is fp32), not only the result
        dequant = largest * (FP8_DEQUANT_FP32_BYTES + (cdt if cdt != 4 else 0))
    fused = fmt.name == "int4" and fused_int4(profile.quant, profile.hardware.gpu)
    fixed["int4_kernel_pack"] = int(kernel_pack_bytes(storage, layout, profile.quant.group_size,
                                                      experts_packed=not on_gpu)) if fused else 0
    if ad.targets_routed_experts:
        notes.append("adapters on routed experts: PEFT builds every expert's bf16 weight per MoE layer "
                     f"({storage.layer_expert_bf16_bytes / GiB:.1f} GiB); prefer adapter.targets: attention+shared")
    if ad.expert_layout != "none":
        held = "; under EP every GPU keeps all experts' factors (only the owner's get gradients)" \
            if layout.expert_parallel_on and ad.expert_layout != "shared" else ""
        notes.append(f"routed-expert adapters: {ad.expert_layout} rank {ad.expert_rank}, "
                     f"{ad.expert_params / 1e9:.3g} B parameters, computed on the routed tokens over the frozen experts "
                     f"(no bf16 expert weights built){held}")
    base = {k: int(v) for k, v in resident_base(storage, layout).items()}

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
        adapter_bytes=2 if profile.adapter.dtype == "bf16" else 4, loss_chunk=mem.loss_chunk_size,
        logit_positions=mb * completion_positions(profile), act_bytes=cdt, keep_frozen=mem.keep_frozen_outputs)
    acts = train_activations(arch, ad, st)

    # ---- rollout ----------------------------------------------------------------------------
    kv, seqs = _kv_cache(profile, arch, mb)
    # the full infer distribution the rollout keeps for the align loss: decoding holds every step's so far beside the
    # last step's sampling (then stacks them, once the sampling's temporaries are gone)
    dist = kept_dist_bytes(profile, arch)
    vocab_terms = _loss_vocab_terms(profile, arch, mb, dist)
    rollout_work = _rollout_working(profile, arch, seqs)
    separate = ro.engine == "separate"
    engine = storage.total_bytes / ro.engine_tp if separate else 0.0
    prefill = seqs * prompt_tokens(profile)  # the prompts' one forward: the largest exchange
    a2a_update = all_to_all_buffers(arch, layout, st.tokens, cdt)
    a2a_rollout = 0.0 if separate else all_to_all_buffers(arch, layout, prefill, cdt)
    comm = communication(profile, arch, storage, layout, ad, micro_batch=mb)
    if not separate and layout.sharded and world > 1:
        what = "every layer's dense part" if layout.expert_parallel_on else "every layer"
        notes.append(f"rollout on the ZeRO-3 shard gathers {what} for every decoded token: "
                     f"{bytes_text(comm.terms['zero3_gather_rollout'])} sent per GPU per RL step")

    if arch.mtp_layers:
        notes.append(f"{arch.mtp_layers} next-token-prediction (MTP) layer(s), {arch.mtp_params / 1e9:.1f} B parameters, "
                     "are not loaded for RL and not planned")
    resident = {**fixed, **base, **resident_states}
    asleep = separate and ro.engine_sleep
    engine_during_update = {} if (not separate or asleep) else {"engine_weights": int(engine),
                                                                "rollout_kv_cache": int(kv)}
    phases = {
        "policy_update": {**resident, "zero3_gather": int(gather), "dequant_transient": int(dequant),
                          "all_to_all_buffers": int(a2a_update),
                          "adapter_gathered": int(states.gathered), "activations": int(acts.activations),
                          "logits_loss": int(acts.logits), "loss_vocab_terms": int(vocab_terms),
                          **engine_during_update},
        "rollout": {**resident, **({"engine_weights": int(engine)} if separate else
                                   {"zero3_gather": int(gather), "dequant_transient": int(dequant),
                                    "all_to_all_buffers": int(a2a_rollout)}),
                    "rollout_kv_cache": int(kv), "rollout_activations": int(rollout_work),
                    "infer_dist": int(seqs * dist)},
        "adapter_sync": {**resident, "adapter_sync": int(2 * ad.trainable_params),
                         **({"engine_weights": int(engine)} if separate else {})},
    }
    if separate and not asleep:
        phases["adapter_sync"]["rollout_kv_cache"] = int(kv)
    if arch.is_moe and not separate:  # the trainer's own infer path records the routing, its update reads it
        # the prompt's routing goes to the host after the prefill, before the decode steps record theirs
        longest = max(prompt_tokens(profile), decoded_tokens(profile))
        phases["rollout"]["routing_record"] = int(routing_record(arch, seqs * longest))
        # the routing to replay, the router's own choice and (replaying) the experts run, for every MoE layer
        copies = 3 if profile.rl.router_replay else 2
        phases["policy_update"]["routing_record"] = int(copies * routing_record(arch, st.tokens))
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))

    # ---- host RAM per node --------------------------------------------------------------------
    host = {
        "processes": PROCESS_HOST_BYTES * gpn,
        "offloaded_activations": int(acts.saved_boundaries_host * gpn),
        "offloaded_optimizer": int(states.host),
        "offloaded_base": int(host_base(storage, layout, gpn, nodes)),
        "sleeping_engine": int(engine * gpn) if asleep else 0,
        "load_path": int(4 * arch.largest_layer_params),
        # the step's recorded routing waits on the host between rollout and update (int16 per index)
        "routing_record": int(routing_record(arch, profile.rl.prompts_per_step * profile.rl.group_size
                                             * decoded_tokens(profile), ROUTE_HOST_BYTES)),
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
                 "routed_expert_adapters": routed_expert_adapters(ad, 2 if profile.adapter.dtype == "bf16" else 4),
                 "layout": layout.name,
                 "expert_parallel": layout.expert_parallel if layout.expert_parallel_on else 1,
                 "dense_layout": layout.dense, "routed_experts_per_gpu": layout.experts_per_rank,
                 "routed_expert_total_bytes": int(storage.expert_bytes)},
        communication=comm,
        timing_of=lambda: step_time(profile, arch, storage, layout, comm,
                                    adapter_bytes=ad.trainable_params * (2 if profile.adapter.dtype == "bf16" else 4),
                                    adapters=ad, offload_bytes=acts.saved_boundaries_host),
    )
