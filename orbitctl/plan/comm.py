"""Bytes each GPU sends in one RL step: ZeRO-3 gathers, expert-parallel all-to-alls, adapter gradient reduction.

One RL step is what ``orbitctl train`` runs per rollout batch: ``rl.prompts_per_step x
rl.group_size`` completions sampled over all ranks, then ``rl.ppo_epochs x rl.minibatches``
optimizer steps on them in micro-batches of ``memory.micro_batch_size``. Every term counts
the bytes one rank sends over the step (ring collectives and an even router: it receives as
many); the formulas are in docs/plan.md, "Communication per RL step". The worst case is
planned: every completion runs ``rollout.max_new_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from orbitctl.arch.spec import ArchSpec
from orbitctl.plan.adapters import AdapterPlan
from orbitctl.plan.layout import Layout, gather_units
from orbitctl.plan.ops import decode_graphs, grouped_experts
from orbitctl.plan.storage import BaseStorage
from orbitctl.units import DTYPE_BYTES, GiB, MiB, TiB

COMM_TERMS = {
    "zero3_gather_rollout": "ZeRO-3 all-gathers while decoding: every sharded unit once per forward "
                            "(the prefill and each decoded token)",
    "zero3_gather_train": "ZeRO-3 all-gathers of the update: forward and backward of each micro-batch "
                          "(+ no-grad log-prob passes)",
    "all_to_all_rollout": "expert-parallel token exchange while decoding: dispatch + combine per MoE layer "
                          "per forward (graphed decode: all-gather + reduce-scatter)",
    "all_to_all_train": "expert-parallel token exchange of the update: dispatch + combine in the forward, "
                        "the recompute and the backward",
    "adapter_allreduce": "adapter gradient reduction (all-reduce, or ZeRO's reduce-scatter + all-gather)",
}
"""Terms in the order `orbitctl plan` prints them, with a one-line meaning."""

COMM_KINDS = {"zero3_gather_rollout": "gathered", "zero3_gather_train": "gathered",
              "all_to_all_rollout": "exchanged", "all_to_all_train": "exchanged", "adapter_allreduce": "all_reduce"}
"""Each term's kind: parameters gathered by ZeRO-3, tokens exchanged by all-to-all, gradients all-reduced."""


def bytes_text(n: float) -> str:
    """A traffic figure, which spans MiB to PiB: '5,822.7 TiB', '9.26 GiB', '3.10 MiB'."""
    if n >= TiB:
        return f"{n / TiB:,.1f} TiB"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


@dataclass(frozen=True)
class StepShape:
    """What one RL step runs on each rank."""

    sequences: int
    """Completions per rank: ceil(prompts_per_step x group_size / G)."""
    rollout_rounds: int
    """Rollout batches decoded one after the other: ceil(sequences / rollout batch)."""
    rollout_forwards: int
    """Forwards per round: one prefill + one per decoded token (max_new_tokens)."""
    prefill_tokens: int
    """Prompt tokens per rank over the step: sequences x (seq_len - max_new_tokens)."""
    decode_tokens: int
    """Decoded tokens per rank over the step: sequences x max_new_tokens."""
    micro_batches: int
    """Forward + backward passes of the update: ppo_epochs x ceil(sequences / micro_batch_size)."""
    no_grad_passes: int
    """Extra no-grad forwards of a micro-batch: old log-probs (ppo_epochs x minibatches > 1), reference (kl_ref_coef > 0)."""
    tokens_per_micro_batch: int
    optimizer_steps: int
    recompute: bool
    """Gradient checkpointing: each layer's forward runs again in the backward."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def rollout_batch(profile, micro_batch: int) -> int:
    """Sequences decoded at once per GPU: rollout.batch_size, else micro-batch x group size (``auto`` is resolved
    before planning: :func:`orbitctl.plan.resolve_rollout_batch`)."""
    if profile.rollout.batch_size == "auto":
        raise ValueError("rollout.batch_size: auto reached the formulas unresolved")
    return profile.rollout.batch_size or micro_batch * profile.rl.group_size


def prefill_rows(profile, batch: int) -> int:
    """Prompts a rollout batch of ``batch`` sequences prefills: the G completions of a group share their prompt, which
    is prefilled once and its cache copied to each row (:func:`orbitctl.model.policy.shared_prompts`). A window of
    ``batch`` rows holds ``batch / G`` groups when G divides it, one when it divides G, else at most
    ``batch // G + 2``. An environment's episodes (rollout.max_turns > 1) are counted per sequence: each turn feeds its
    sequence's new tokens (the environment's reply) on the cache kept from the last turn
    (:func:`orbitctl.rl.multiturn.play`), so prompt and replies are prefilled once per sequence in all."""
    group = profile.rl.group_size
    if profile.rollout.max_turns > 1:
        return batch
    if batch % group == 0:
        return batch // group
    if group % batch == 0:
        return 1
    return min(batch, batch // group + 2)


def decoded_tokens(profile) -> int:
    """Tokens the policy decodes per rollout sequence: max_new_tokens per turn, rollout.max_turns turns (an
    environment's replies between the turns are prefilled, counted with the prompt in seq_len)."""
    return profile.rollout.max_new_tokens * profile.rollout.max_turns


def decode_forwards(profile) -> int:
    """Decode-step forwards per rollout sequence: each sampled token is fed back but a turn's last (its logits would
    predict nothing kept: :meth:`orbitctl.model.policy.Policy.sample` stops there)."""
    return (profile.rollout.max_new_tokens - 1) * profile.rollout.max_turns


def prompt_tokens(profile) -> int:
    """Prompt tokens of one rollout sequence: what the completion leaves of seq_len (at least 1)."""
    return max(1, profile.memory.seq_len - decoded_tokens(profile))


def completions_per_gpu(profile) -> int:
    """Completions one RL step samples on each GPU (rank): prompts x group over the ranks, rounded up."""
    return math.ceil(profile.rl.prompts_per_step * profile.rl.group_size / profile.world_size)


def step_shape(profile, micro_batch: int | None = None) -> StepShape:
    """The step's counts; ``micro_batch`` overrides memory.micro_batch_size (and the rollout batch it implies)."""
    mem, rl = profile.memory, profile.rl
    mb = micro_batch or mem.micro_batch_size
    sequences = completions_per_gpu(profile)
    batch = rollout_batch(profile, mb)
    per_epoch = math.ceil(sequences / mb)
    micro = rl.ppo_epochs * per_epoch
    old_logprobs = per_epoch if rl.ppo_epochs * rl.minibatches > 1 else 0
    reference = micro if rl.kl_ref_coef > 0 else 0
    return StepShape(
        sequences=sequences, rollout_rounds=math.ceil(sequences / batch), rollout_forwards=1 + decode_forwards(profile),
        prefill_tokens=sequences * prompt_tokens(profile), decode_tokens=sequences * decoded_tokens(profile),
        micro_batches=micro, no_grad_passes=old_logprobs + reference, tokens_per_micro_batch=mb * mem.seq_len,
        optimizer_steps=rl.ppo_epochs * rl.minibatches, recompute=mem.gradient_checkpointing)


def compute_dtype_bytes(profile) -> int:
    """Bytes of one activation element: quant.compute_dtype, auto as bf16 (the GPU rule)."""
    return DTYPE_BYTES.get(profile.quant.compute_dtype, 2)


def all_to_all_buffers(arch: ArchSpec, layout: Layout, tokens: int, dtype_bytes: int) -> float:
    """One MoE layer in flight: tokens x top_k x hidden, send and receive, dispatch and combine."""
    if not layout.expert_parallel_on:
        return 0.0
    return 4.0 * tokens * arch.experts_per_token * arch.hidden_size * dtype_bytes


@dataclass
class Communication:
    """Bytes one GPU sends in one RL step, by term, for the profile's layout."""

    layout: str
    terms: dict[str, int]
    shape: StepShape
    link_bytes_per_s: float
    """One direction of the GPU's peer link (the catalog's bidirectional NVLink/PCIe figure / 2); 0 unknown."""
    decode_graphs: bool = False
    """The rollout's decode steps replay CUDA graphs (orbitctl.plan.ops.decode_graphs): the exchange at static shapes
    here, the replayed kernels and the static cache's length in the time model."""

    @property
    def total_bytes(self) -> int:
        return sum(self.terms.values())

    def by_kind(self) -> dict[str, int]:
        """Bytes gathered, exchanged and all-reduced (COMM_KINDS)."""
        out = dict.fromkeys(COMM_KINDS.values(), 0)
        for term, n in self.terms.items():
            out[COMM_KINDS[term]] += n
        return out

    @property
    def link_seconds(self) -> float | None:
        """total / link bandwidth: a lower bound (no latency, no overlap, intra-node links)."""
        return self.total_bytes / self.link_bytes_per_s if self.link_bytes_per_s else None

    def to_dict(self) -> dict[str, Any]:
        seconds = self.link_seconds
        return {"layout": self.layout, "bytes": dict(self.terms), "by_kind": self.by_kind(), "total_bytes": self.total_bytes,
                "link_bytes_per_s": int(self.link_bytes_per_s),
                "link_seconds": None if seconds is None else round(seconds, 3), "step": self.shape.to_dict()}


def link_bytes_per_s(profile) -> float:
    from orbitctl.profile.gpus import resolve_gpu

    spec = resolve_gpu(profile.hardware.gpu)
    return spec.p2p_bandwidth_gbs * 1e9 / 2 if spec is not None else 0.0


def communication(profile, arch: ArchSpec, storage: BaseStorage, layout: Layout, adapters: AdapterPlan, *,
                  micro_batch: int | None = None) -> Communication:
    """The five terms of COMM_TERMS for one RL step of ``profile`` under ``layout``."""
    shape = step_shape(profile, micro_batch)
    mem, world = profile.memory, profile.world_size
    ring = (world - 1) / world
    weight_bytes = 2 if profile.adapter.dtype == "bf16" else 4
    adapter_bytes = adapters.trainable_params * weight_bytes
    shared_engine = profile.rollout.engine == "shared"

    # ZeRO-3: every partitioned unit is all-gathered once per forward; the adapters too under stage 3
    gathered = sum(gather_units(storage, layout))
    if mem.zero_stage == 3:
        gathered += weight_bytes * (adapters.trainable_params - adapters.persistent_params)
    per_forward = gathered * ring
    # a checkpointed layer's recompute and its backward share one gather (the layer is reused at once,
    # within stage3_max_reuse_distance); without checkpointing the backward gathers it again
    train_gathers = 2 * shape.micro_batches + shape.no_grad_passes
    rollout_gathers = shape.rollout_rounds * shape.rollout_forwards if shared_engine else 0

    # expert parallelism: per MoE layer and exchange, each token's k hidden vectors; 1/P stays local
    if layout.expert_parallel_on:
        p = layout.expert_parallel
        per_token = arch.moe_layers * arch.experts_per_token * arch.hidden_size * compute_dtype_bytes(profile) * (p - 1) / p
    else:
        per_token = 0.0
    train_passes = shape.micro_batches * (2 + shape.recompute) + shape.no_grad_passes  # forward, recompute, backward
    a2a_train = 2 * per_token * shape.tokens_per_micro_batch * train_passes
    fed = shape.sequences * decode_forwards(profile)  # decode steps feed every sampled token back but a turn's last
    # a graphed decode step exchanges at static shapes: each token's vector to every other rank and each rank's
    # partial sums back (all-gather + reduce-scatter), P / k times the all-to-all's k vectors
    graphed = decode_graphs(profile, moe=arch.is_moe, gathered=rollout_gathers * per_forward > 0,
                            grouped=grouped_experts(profile, adapters))
    static = layout.expert_parallel / arch.experts_per_token if graphed and layout.expert_parallel_on else 1.0
    a2a_rollout = 2 * per_token * (shape.prefill_tokens + fed * static) if shared_engine else 0.0

    # adapter gradients: stages 0-1 reduce once per optimizer step (all-reduce; stage 1 as reduce-scatter +
    # all-gather of the updated weights), 2-3 reduce-scatter every micro-batch, 2 all-gathers the update
    if world == 1:
        reduce = 0.0
    elif mem.zero_stage <= 1:
        reduce = 2 * ring * adapter_bytes * shape.optimizer_steps
    else:
        reduce = ring * adapter_bytes * shape.micro_batches
        if mem.zero_stage == 2:
            reduce += ring * adapter_bytes * shape.optimizer_steps
    terms = {"zero3_gather_rollout": int(per_forward * rollout_gathers),
             "zero3_gather_train": int(per_forward * train_gathers),
             "all_to_all_rollout": int(a2a_rollout), "all_to_all_train": int(a2a_train),
             "adapter_allreduce": int(reduce)}
    return Communication(layout.name, terms, shape, link_bytes_per_s(profile), graphed)
