"""Seconds one RL step takes per phase: compute, HBM traffic and communication, on one node or several.

The time model beside the memory model, from the same profile, ArchSpec, stored base and layout.
Each phase (``rollout``: prefill + decode on the shared weights; ``policy_update``: the
update's forwards, recompute and backwards; ``adapter_sync``: pushing the adapter to a
separate engine, zero for the shared one) gets three figures per GPU:

- ``flops``: 2 x active parameters per token, attention's sequence term, the no-grad log-prob
  forwards and the recompute of gradient checkpointing;
- ``hbm_bytes``: the weights each forward reads (of a MoE layer only the experts the batch
  touches, E (1 - (1 - k/E)^B)), the KV cache each decoded token reads and the bf16 copy plain-torch
  dequantization writes and reads back;
- ``comm_bytes``: comm.py's terms of the phase, split into intra-node and inter-node bytes.

Each figure becomes seconds at the catalog's peak times an efficiency factor (the module
constants below, sourced in docs/plan.md, "Time per RL step"); overridable by passing
``Efficiency``. Overlap rule: compute and HBM traffic overlap (roofline), communication does
not: phase seconds = max(compute, memory) + communication. Imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orbitctl.arch.spec import EXPERT, ArchSpec
from orbitctl.plan.comm import Communication, prompt_tokens, rollout_batch
from orbitctl.plan.layout import Layout
from orbitctl.plan.storage import BaseStorage

COMPUTE_EFFICIENCY = 0.5
"""Fraction of the dense BF16 peak large training GEMMs sustain (model FLOPs utilisation of tuned
training: 46-56% in Megatron-LM and PaLM reports)."""
HBM_EFFICIENCY = 0.8
"""Fraction of the catalog's HBM bandwidth a streaming read reaches (STREAM-type kernels: 80-90%)."""
LINK_EFFICIENCY = 0.7
"""Fraction of one direction of the peer link NCCL's bus bandwidth reaches on large messages (nccl-tests)."""
NIC_GBITS_PER_GPU = 400.0
"""Inter-node bandwidth per GPU, Gb/s: one 400 Gb/s InfiniBand NDR adapter per GPU (DGX/HGX H100, H200, B200)."""
DEQUANT_PASSES = 2
"""A plain-torch dequantization writes the bf16 copy of each weight it uses and the matmul reads it back."""

BOUNDS = ("compute", "HBM", "interconnect")
TIME_PHASES = ("rollout", "policy_update", "adapter_sync")


@dataclass(frozen=True)
class Efficiency:
    """The factors applied to the catalog's peaks; the defaults are the module constants."""

    compute: float = COMPUTE_EFFICIENCY
    hbm: float = HBM_EFFICIENCY
    link: float = LINK_EFFICIENCY
    nic_gbits_per_gpu: float = NIC_GBITS_PER_GPU


@dataclass(frozen=True)
class Peaks:
    """One GPU's peaks: FLOP/s, HBM bytes/s, peer-link and inter-node bytes/s (one direction)."""

    flops: float
    hbm: float
    link: float
    nic: float


def peaks_of(profile, eff: Efficiency = Efficiency()) -> Peaks:
    """The catalog's peaks for hardware.gpu (the link: its bidirectional figure / 2; CPU ranks: the HBM figure)."""
    from orbitctl.profile.gpus import resolve_gpu

    spec = resolve_gpu(profile.hardware.gpu)
    link = spec.p2p_bandwidth_gbs * 1e9 / 2 or spec.hbm_bandwidth_gbs * 1e9  # CPU ranks talk through memory
    return Peaks(flops=spec.bf16_tflops * 1e12, hbm=spec.hbm_bandwidth_gbs * 1e9, link=link,
                 nic=eff.nic_gbits_per_gpu * 1e9 / 8)


@dataclass
class PhaseTime:
    """One phase per GPU: what it moves and computes, its floor and its predicted seconds."""

    flops: float
    hbm_bytes: float
    intra_bytes: float
    """Communication over the node's peer links."""
    inter_bytes: float
    """Communication that crosses nodes (InfiniBand)."""
    tokens: int
    """Tokens the phase processes over all GPUs (decoded tokens for the rollout)."""
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    floor_s: float = 0.0
    """max(FLOPs / peak FLOP/s, bytes / peak HBM, comm bytes / peak links): no run can be faster."""
    parts: dict[str, PhaseTime] = field(default_factory=dict)
    """Sub-phases (rollout: prefill, decode), each timed on its own."""

    @property
    def seconds(self) -> float:
        """The overlap rule: max(compute, memory) + communication; with sub-phases, which run one after the
        other, the sum of theirs."""
        if self.parts:
            return sum(p.seconds for p in self.parts.values())
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def bound(self) -> str:
        """The largest of the three terms: compute, HBM or interconnect ('-' for an empty phase)."""
        if not self.seconds:
            return "-"
        return max(zip((self.compute_s, self.memory_s, self.comm_s), BOUNDS))[1]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "parts"}
        doc.update(seconds=self.seconds, bound=self.bound, tokens_per_s=self.tokens_per_s,
                   parts={k: p.to_dict() for k, p in self.parts.items()})
        return doc


def _timed(phase: PhaseTime, peaks: Peaks, eff: Efficiency) -> PhaseTime:
    nic = peaks.nic if phase.inter_bytes else 1.0
    phase.compute_s = phase.flops / (peaks.flops * eff.compute)
    phase.memory_s = phase.hbm_bytes / (peaks.hbm * eff.hbm)
    phase.comm_s = (phase.intra_bytes / peaks.link + phase.inter_bytes / nic) / eff.link
    phase.floor_s = max(phase.flops / peaks.flops, phase.hbm_bytes / peaks.hbm,
                        phase.intra_bytes / peaks.link + phase.inter_bytes / nic)
    return phase


@dataclass
class StepTime:
    """Predicted seconds of one RL step by phase, for the profile's layout and node count."""

    phases: dict[str, PhaseTime]
    world: int
    nodes: int
    efficiency: Efficiency

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.world / 3600

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "gpu_hours": self.gpu_hours, "world": self.world, "nodes": self.nodes,
                "rollout_tokens_per_s": self.phases["rollout"].tokens_per_s,
                "update_tokens_per_s": self.phases["policy_update"].tokens_per_s,
                "efficiency": asdict(self.efficiency), "phases": {k: p.to_dict() for k, p in self.phases.items()}}


def attention_flops(arch: ArchSpec, tokens: float, context: float) -> float:
    """QK^T and AV of ``tokens`` queries over ``context`` keys, every layer: 2 x heads x (d_qk + d_v) x context."""
    if arch.attention == "mla":
        qk, v = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.v_head_dim
    else:
        qk = v = arch.head_dim
    return 2.0 * arch.num_layers * arch.num_heads * (qk + v) * context * tokens


def touched_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` routed tokens reach: E (1 - (1 - k/E)^B) (even, independent routing)."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class WeightReads:
    """HBM bytes one forward of ``tokens`` tokens reads on one GPU, by where they live."""

    dense: float
    """Stored dense part (attention, shared experts, dense layers, lm_head, norms) + its dequantized copy."""
    per_expert: float
    """One routed expert of one layer, stored + its dequantized copy."""
    experts_held: int
    """Routed experts of one MoE layer this GPU computes: E/P under expert parallelism, else E."""
    moe_layers: int
    num_experts: int
    top_k: int
    group: int
    """Ranks whose tokens reach this GPU's experts: P under expert parallelism, else 1."""

    def bytes(self, tokens: float) -> float:
        hit = touched_experts(self.num_experts, self.top_k, tokens * self.group) / max(self.num_experts, 1)
        return self.dense + self.moe_layers * self.experts_held * hit * self.per_expert


def weight_reads(arch: ArchSpec, storage: BaseStorage, layout: Layout) -> WeightReads:
    """The weights a forward reads: the embedding is a lookup (unless tied to the head), dequantized weights twice more."""
    dense_stored = storage.total_bytes - storage.expert_bytes - (storage.embedding_bytes if arch.lm_head else 0)
    dense_params = arch.params_total - arch.params_by_kind[EXPERT] - (arch.embedding.numel if arch.lm_head else 0)
    dense_bf16 = 2.0 * dense_params
    expert_params = arch.params_by_kind[EXPERT]
    moe = arch.moe_layers
    per_expert_stored = storage.expert_bytes / (moe * arch.num_experts) if moe else 0.0
    per_expert_bf16 = 2.0 * expert_params / (moe * arch.num_experts) if moe else 0.0
    # a weight stored well under bf16 is quantized: dequantized into a bf16 copy on every use
    expert_deq = DEQUANT_PASSES * per_expert_bf16 if per_expert_stored < 0.75 * per_expert_bf16 else 0.0
    dense_quantized = storage.quantized_params - (expert_params if expert_deq else 0)
    dense_deq = DEQUANT_PASSES * 2.0 * max(0, min(dense_quantized, dense_params))
    return WeightReads(dense=max(dense_stored, 0.0) + dense_deq, per_expert=per_expert_stored + expert_deq,
                       experts_held=layout.experts_per_rank, moe_layers=moe, num_experts=arch.num_experts,
                       top_k=arch.experts_per_token, group=layout.expert_parallel if layout.expert_parallel_on else 1)


def kv_bytes_per_token(profile, arch: ArchSpec) -> float:
    """KV-cache bytes one cached token keeps, every layer (kv_dtype fp8: 1 byte, else 2)."""
    return arch.num_layers * arch.kv_elements_per_token_layer() * (1 if profile.rollout.kv_dtype == "fp8" else 2)


def _split(profile, layout: Layout, ring_bytes: float, a2a_bytes: float) -> tuple[float, float]:
    """(intra-node, inter-node) bytes: ring collectives over all ranks cross nodes when there are several
    (the NIC is their slowest hop); an expert group's all-to-all crosses for its peers on other nodes."""
    gpn, nodes = profile.hardware.gpus_per_node, profile.hardware.nodes
    intra, inter = (0.0, ring_bytes) if nodes > 1 else (ring_bytes, 0.0)
    p = layout.expert_parallel
    remote = max(0, p - gpn) / (p - 1) if p > 1 else 0.0
    return intra + a2a_bytes * (1 - remote), inter + a2a_bytes * remote


def step_time(profile, arch: ArchSpec, storage: BaseStorage, layout: Layout, comm: Communication,
              adapter_bytes: float = 0.0, eff: Efficiency = Efficiency(), peaks: Peaks | None = None) -> StepTime:
    """The three phases of one RL step per GPU (docs/plan.md, "Time per RL step"); ``peaks`` replaces the
    catalog's (``plan --measure-time`` passes the rates it measured, with efficiency 1)."""
    peaks = peaks or peaks_of(profile, eff)
    shape, world, ro = comm.shape, profile.world_size, profile.rollout
    reads = weight_reads(arch, storage, layout)
    active = arch.params_active
    terms = comm.terms

    # ---- rollout: per round one prefill of the prompts, then max_new_tokens decode steps
    batch = min(rollout_batch(profile, shape.tokens_per_micro_batch // profile.memory.seq_len), shape.sequences)
    prompt, new = prompt_tokens(profile), ro.max_new_tokens
    rounds = shape.rollout_rounds
    kv = kv_bytes_per_token(profile, arch)
    intra, inter = _split(profile, layout, terms["zero3_gather_rollout"], terms["all_to_all_rollout"])
    first = 1 / shape.rollout_forwards  # the prefill's share of the per-forward traffic
    prefill = _timed(PhaseTime(
        flops=rounds * (2.0 * active * batch * prompt + attention_flops(arch, batch * prompt, prompt / 2)),
        hbm_bytes=rounds * (reads.bytes(batch * prompt) + batch * prompt * kv),
        intra_bytes=intra * first, inter_bytes=inter * first, tokens=0), peaks, eff)
    mean_context = prompt + (new + 1) / 2
    decode = _timed(PhaseTime(
        flops=rounds * new * (2.0 * active * batch + attention_flops(arch, batch, mean_context)),
        hbm_bytes=rounds * new * (reads.bytes(batch) + batch * mean_context * kv),
        intra_bytes=intra * (1 - first), inter_bytes=inter * (1 - first), tokens=shape.decode_tokens * world),
        peaks, eff)
    rollout = PhaseTime(flops=prefill.flops + decode.flops, hbm_bytes=prefill.hbm_bytes + decode.hbm_bytes,
                        intra_bytes=intra, inter_bytes=inter, tokens=shape.decode_tokens * world)
    _timed(rollout, peaks, eff)  # its floor from the totals; its terms and seconds are the sub-phases' sums
    rollout.compute_s = prefill.compute_s + decode.compute_s
    rollout.memory_s = prefill.memory_s + decode.memory_s
    rollout.parts = {"prefill": prefill, "decode": decode}

    # ---- policy update: forward, recompute and backward of every micro-batch, plus the no-grad forwards
    seq = profile.memory.seq_len
    t = min(shape.tokens_per_micro_batch // seq, shape.sequences) * seq  # a micro-batch is no larger than the rank's share
    linear, attn = 2.0 * active * t, attention_flops(arch, t, seq / 2)
    forward = linear + attn
    backward = linear + 2 * attn  # frozen base: input gradients only (no weight-gradient GEMM); attention 2x
    passes = shape.micro_batches * (2 + shape.recompute) + shape.no_grad_passes
    intra, inter = _split(profile, layout, terms["zero3_gather_train"] + terms["adapter_allreduce"],
                          terms["all_to_all_train"])
    update = _timed(PhaseTime(
        flops=shape.micro_batches * (forward * (1 + shape.recompute) + backward) + shape.no_grad_passes * forward,
        hbm_bytes=passes * reads.bytes(t), intra_bytes=intra, inter_bytes=inter,
        tokens=shape.micro_batches * t * world), peaks, eff)

    # ---- adapter sync: a separate engine receives the whole adapter once per step; the shared one nothing
    sync_bytes = adapter_bytes if ro.engine == "separate" else 0.0
    intra, inter = _split(profile, layout, sync_bytes, 0.0)
    sync = _timed(PhaseTime(flops=0, hbm_bytes=0, intra_bytes=intra, inter_bytes=inter, tokens=0), peaks, eff)
    return StepTime({"rollout": rollout, "policy_update": update, "adapter_sync": sync}, world,
                    profile.hardware.nodes, eff)


def seconds_text(s: float | None) -> str:
    """'28.1 s', '5.4 min', '7.9 h', '12 ms'; '0' for nothing, '-' when unknown."""
    if s is None:
        return "-"
    if s == 0:
        return "0"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 100:
        return f"{s / 60:.0f} min"
    return f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.0f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def nodes_change(profile) -> dict[str, Any] | None:
    """The same run on twice the nodes (equal global batch), or None when it already spans nodes."""
    if profile.hardware.nodes > 1 or profile.world_size == 1:
        return None
    return {"hardware.nodes": 2}
