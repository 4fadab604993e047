"""Seconds one RL step takes per phase: compute, HBM traffic and communication, on one node or several.

The time model beside the memory model, from the same profile, ArchSpec, stored base and layout.
Each phase (``rollout``: prefill + decode on the shared weights; ``policy_update``: the
update's forwards, recompute and backwards; ``adapter_sync``: pushing the adapter to a
separate engine, zero for the shared one) gets three figures per GPU:

- ``flops``: 2 x active parameters per token, attention's sequence term, the no-grad log-prob
  forwards and the recompute of gradient checkpointing;
- ``hbm_bytes``: the weights each forward reads (of a MoE layer only the experts the batch
  touches, E (1 - (1 - k/E)^B)), the KV cache each decoded token reads and the bf16 copy plain-torch
  dequantization writes and reads back; on a CPU also the elementwise ops' activation traffic;
- ``comm_bytes``: comm.py's terms of the phase, split into intra-node and inter-node bytes;
- ``ops``: the eager operators the phase issues (ops.py: counted from the architecture), each
  costing ``Peaks.op_s`` (a CUDA kernel launch, or a CPU op's dispatch as measured).

Each figure becomes seconds at the catalog's peak times an efficiency factor (the module
constants below, sourced in docs/plan.md, "Time per RL step"); overridable by passing
``Efficiency``. Overlap rule: compute and HBM traffic overlap (roofline), communication does
not; a GPU's launches overlap its kernels (asynchronous): GPU seconds = max(compute, memory,
overhead) + communication. A CPU runs one op after another, each bound by its own FLOPs (a
GEMM) or bytes (an elementwise op), and pays each op's overhead: CPU seconds = compute + memory
+ overhead + communication. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from orbitctl.arch.spec import EXPERT, ArchSpec
from orbitctl.plan.comm import (Communication, decode_forwards, decoded_tokens, prefill_rows, prompt_tokens,
                               rollout_batch)
from orbitctl.plan.layout import Layout
from orbitctl.plan.ops import (BACKWARD_OPS, GRAPH_EAGER_STEPS, GRAPH_KERNELS_PER_OP, OPS_GRAPH_STEP, OPS_LOSS,
                               OPS_OPTIMIZER, OPS_SAMPLE, activation_bytes_per_token, adapter_active_params,
                               attention_blocks, experts_fused, fused_int4, grouped_experts, op_counts)
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
KERNEL_LAUNCH_S = 5e-6
"""Seconds per eager op on a GPU: one CUDA kernel launch plus PyTorch's dispatch, 4-10 us (NVIDIA: a launch costs
about 5 us of host time; PyTorch eager overhead, "Making Deep Learning Go Brrrr", He 2022: ~10 us per op); the low
end is taken. Asynchronous: it overlaps the kernels already queued."""
GRAPH_KERNEL_S = 2e-6
"""Seconds per kernel of a replayed CUDA graph: no host launch, the GPU running its nodes back to back. NVIDIA's
"Getting Started with CUDA Graphs" (Gray, 2019) measures a 2.9 us kernel at 3.4 us per node in a graph against 3.8 us
stream-launched, ~0.5 us between nodes; a decode step's small kernels (tens of rows) run 1-2 us each. The low end of
what a replayed kernel costs, whatever it computes; its FLOPs and bytes are the compute and HBM terms."""
CPU_OP_S = 7e-6
"""Seconds per eager op on the catalog's ``cpu`` entry when nothing is measured (``--measure-time`` measures it):
the op microbenchmark of orbitctl.rl.steptime (transformers' RMSNorm and MLP modules at hidden 64) on a 2-core
AVX512-BF16 EPYC, bf16, one thread, cores otherwise idle (6.8-7.3 us)."""
CPU_BLOCK_S = 4e-6
"""Seconds per attention work item (one sequence x head) of ATen's CPU attention kernel when nothing is measured:
the same machine's microbenchmark (4.5 us in bf16, 2.0 us in fp32)."""

HOST_SYNC_S = 15e-6
"""Seconds the device idles per decode step while the host reads whether every row is done (the sampler's one
device-to-host read a step: a stream synchronisation and an 8-byte copy, 10-20 us; an assumption, not measured on a
GPU). The next step's launch waits for it: serial, never hidden under the kernels."""
LOCKSTEP_S = 25e-6
"""Seconds per decode step of the expert-parallel lockstep's all-reduce of one integer over the EP group (NCCL's
small-message latency within an NVLink node, 10-30 us in nccl-tests; an assumption). Serial like the read."""
KEYED_DRAW_S = 2.5e-6
"""Host seconds per row and decode step to compute its keyed uniform (orbitctl.model.draws: three splitmix64 rounds
in Python; measured 1.5-3.7 us a row on a 2-core AMD EPYC); the row's inverse CDF itself runs on the device."""

BOUNDS = ("compute", "HBM", "interconnect", "overhead")
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
    """One GPU's peaks: FLOP/s, HBM bytes/s, peer-link and inter-node bytes/s (one direction), seconds per eager op."""

    flops: float
    hbm: float
    link: float
    nic: float
    op_s: float = KERNEL_LAUNCH_S
    """Seconds one eager op costs the host: a kernel launch (GPU), a CPU op's dispatch and framework overhead."""
    synchronous: bool = False
    """The host runs the ops itself (CPU): their overhead adds to the compute instead of hiding under it."""
    block_s: float = 0.0
    """Seconds per attention work item (sequence x head) of a CPU attention kernel; 0 on a GPU (one launch)."""
    adapter_flops: float = 0.0
    """FLOP/s of the adapters' thin matmuls (tokens x hidden x rank); 0: the same as ``flops``."""
    graph_kernel_s: float = GRAPH_KERNEL_S
    """Seconds per kernel of a replayed CUDA graph."""
    kernel_flops: tuple[tuple[int, float], ...] = ()
    """FLOP/s of the fused INT4 kernel (``quant.kernel``) measured at a few row counts, ``(rows, FLOP/s)`` by rows;
    empty: the same as ``flops`` (the catalog's GPUs). A CPU's kernel runs its own loops, whose rate depends on the
    rows far more than a GEMM's (a decode step's tens of rows against an update's thousands)."""

    def kernel_rate(self, rows: float) -> float:
        """The fused kernel's FLOP/s at ``rows`` rows: interpolated in log rows between the measured points, the
        nearest one's outside them; ``flops`` when none is measured."""
        points = self.kernel_flops
        if not points:
            return self.flops
        if rows <= points[0][0]:
            return points[0][1]
        for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
            if rows <= high:
                share = math.log(rows / low) / math.log(high / low)
                return math.exp(math.log(low_rate) + share * (math.log(high_rate) - math.log(low_rate)))
        return points[-1][1]


def peaks_of(profile, eff: Efficiency = Efficiency()) -> Peaks:
    """The catalog's peaks for hardware.gpu (the link: its bidirectional figure / 2; CPU ranks: the HBM figure)."""
    from orbitctl.profile.gpus import resolve_gpu

    spec = resolve_gpu(profile.hardware.gpu)
    link = spec.p2p_bandwidth_gbs * 1e9 / 2 or spec.hbm_bandwidth_gbs * 1e9  # CPU ranks talk through memory
    cpu = spec.vendor == "cpu"
    return Peaks(flops=spec.bf16_tflops * 1e12, hbm=spec.hbm_bandwidth_gbs * 1e9, link=link,
                 nic=eff.nic_gbits_per_gpu * 1e9 / 8, op_s=CPU_OP_S if cpu else KERNEL_LAUNCH_S, synchronous=cpu,
                 block_s=CPU_BLOCK_S if cpu else 0.0)


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
    ops: float = 0.0
    """Eager operators the phase issues (ops.py)."""
    items: float = 0.0
    """Attention work items (sequence x head per layer) a CPU attention kernel loops over."""
    adapter_flops: float = 0.0
    """The part of ``flops`` in the adapters' thin matmuls."""
    graph_kernels: float = 0.0
    """Kernels replayed from CUDA graphs (the graphed decode steps), each costing ``Peaks.graph_kernel_s``."""
    kernel_work: tuple[tuple[float, float], ...] = ()
    """The part of ``flops`` in the fused INT4 kernel (the frozen base's forward matmuls), as ``(FLOPs, rows per
    call)`` pairs: the dense weights meet a forward's tokens, a routed expert the tokens routed to it. Timed at
    ``Peaks.kernel_rate`` of those rows."""
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    overhead_s: float = 0.0
    """ops x seconds per op + attention items x seconds per item + graph kernels x seconds per replayed kernel."""
    host_s: float = 0.0
    """Serial host work the device waits for (a GPU's decode: the per-step read of the done flag, the expert-parallel
    lockstep, the keyed draws' uniforms); added to the phase's seconds, never overlapped."""
    synchronous: bool = False
    floor_s: float = 0.0
    """max(FLOPs / peak FLOP/s, bytes / peak HBM, comm bytes / peak links): no run can be faster."""
    parts: dict[str, PhaseTime] = field(default_factory=dict)
    """Sub-phases (rollout: prefill, decode), each timed on its own."""

    @property
    def kernel_flops(self) -> float:
        return sum(flops for flops, _ in self.kernel_work)

    @property
    def seconds(self) -> float:
        """The overlap rule: max(compute, memory) + communication; with sub-phases, which run one after the
        other, the sum of theirs."""
        if self.parts:
            return sum(p.seconds for p in self.parts.values())
        if self.synchronous:  # one op after another: a GEMM's FLOPs, an elementwise op's bytes, each op's overhead
            return self.compute_s + self.memory_s + self.overhead_s + self.comm_s + self.host_s
        return max(self.compute_s, self.memory_s, self.overhead_s) + self.comm_s + self.host_s

    @property
    def bound(self) -> str:
        """The largest of the four terms: compute, HBM, interconnect or overhead ('-' for an empty phase)."""
        if not self.seconds:
            return "-"
        return max(zip((self.compute_s, self.memory_s, self.comm_s, self.overhead_s), BOUNDS))[1]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "parts"}
        doc.update(seconds=self.seconds, bound=self.bound, tokens_per_s=self.tokens_per_s, kernel_flops=self.kernel_flops,
                   parts={k: p.to_dict() for k, p in self.parts.items()})
        return doc


def _timed(phase: PhaseTime, peaks: Peaks, eff: Efficiency) -> PhaseTime:
    nic = peaks.nic if phase.inter_bytes else 1.0
    thin = peaks.adapter_flops or peaks.flops
    kernel_s = sum(flops / peaks.kernel_rate(rows) for flops, rows in phase.kernel_work)
    phase.compute_s = ((phase.flops - phase.adapter_flops - phase.kernel_flops) / peaks.flops
                       + phase.adapter_flops / thin + kernel_s) / eff.compute
    phase.overhead_s = phase.ops * peaks.op_s + phase.items * peaks.block_s + phase.graph_kernels * peaks.graph_kernel_s
    phase.synchronous = peaks.synchronous
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
    steps: int = 1
    """RL steps of the run (rl.steps): one rollout batch and its updates each."""
    price_per_gpu_hour: float | None = None
    """hardware.price_per_gpu_hour, USD; None: no cost."""

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def gpu_hours(self) -> float:
        """GPU-hours of one step: seconds x GPUs / 3600."""
        return self.seconds * self.world / 3600

    @property
    def run_gpu_hours(self) -> float:
        return self.gpu_hours * self.steps

    @property
    def cost_per_step(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.gpu_hours * self.price_per_gpu_hour

    @property
    def cost_per_run(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.run_gpu_hours * self.price_per_gpu_hour

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "gpu_hours": self.gpu_hours, "world": self.world, "nodes": self.nodes,
                "steps": self.steps, "run_seconds": self.seconds * self.steps, "run_gpu_hours": self.run_gpu_hours,
                "price_per_gpu_hour": self.price_per_gpu_hour, "cost_per_step": self.cost_per_step,
                "cost_per_run": self.cost_per_run,
                "rollout_tokens_per_s": self.phases["rollout"].tokens_per_s,
                "update_tokens_per_s": self.phases["policy_update"].tokens_per_s,
                "efficiency": asdict(self.efficiency), "phases": {k: p.to_dict() for k, p in self.phases.items()}}


def attention_flops(arch: ArchSpec, tokens: float, context: float, decode: bool = False) -> float:
    """QK^T and AV of ``tokens`` queries over ``context`` keys, every layer: 2 x heads x (d_qk + d_v) x context. An
    MLA decode step attends on the cached latent (orbitctl.model.mla): QK^T over kv_lora + rope, AV over kv_lora."""
    if arch.attention == "mla" and decode:
        qk, v = arch.kv_lora_rank + arch.qk_rope_head_dim, arch.kv_lora_rank
    elif arch.attention == "mla":
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
    kernel_params: float = 0.0
    """Dense parameters a token multiplies through the fused INT4 kernel (0 when the forward dequantizes)."""
    kernel_expert_params: float = 0.0
    """Routed-expert parameters a token multiplies through it: its top-k experts', where they run it."""

    def kernel_work(self, tokens: float, passes: float = 1.0) -> tuple[tuple[float, float], ...]:
        """``(FLOPs, rows per call)`` of the fused kernel in ``passes`` forwards of ``tokens`` tokens each: the dense
        weights at ``tokens`` rows, each hit expert at the slots routed to it (from all ``group`` ranks)."""
        work = []
        if self.kernel_params:
            work.append((passes * 2.0 * self.kernel_params * tokens, tokens))
        if self.kernel_expert_params:
            hit = touched_experts(self.num_experts, self.top_k, tokens * self.group)
            work.append((passes * 2.0 * self.kernel_expert_params * tokens, tokens * self.group * self.top_k / hit))
        return tuple(work)

    def bytes(self, tokens: float) -> float:
        hit = touched_experts(self.num_experts, self.top_k, tokens * self.group) / max(self.num_experts, 1)
        return self.dense + self.moe_layers * self.experts_held * hit * self.per_expert


def weight_reads(arch: ArchSpec, storage: BaseStorage, layout: Layout, fused: bool = False,
                 experts_fused: bool | None = None) -> WeightReads:
    """The weights a forward reads: the embedding is a lookup (unless tied to the head), dequantized weights twice more
    (``fused``: the INT4 kernel reads the 4-bit codes once and writes no copy, :mod:`orbitctl.model.int4_kernel`;
    ``experts_fused``: the same for the routed experts, when it differs: a GPU's ungrouped experts dequantize)."""
    dense_stored = storage.total_bytes - storage.expert_bytes - (storage.embedding_bytes if arch.lm_head else 0)
    dense_params = arch.params_total - arch.params_by_kind[EXPERT] - (arch.embedding.numel if arch.lm_head else 0)
    expert_params = arch.params_by_kind[EXPERT]
    moe = arch.moe_layers
    per_expert_stored = storage.expert_bytes / (moe * arch.num_experts) if moe else 0.0
    per_expert_bf16 = 2.0 * expert_params / (moe * arch.num_experts) if moe else 0.0
    # a weight stored well under bf16 is quantized: dequantized into a bf16 copy on every use
    copies = 0 if fused else DEQUANT_PASSES
    expert_copies = copies if experts_fused is None else (0 if experts_fused else DEQUANT_PASSES)
    quantized_experts = per_expert_stored < 0.75 * per_expert_bf16
    expert_deq = expert_copies * per_expert_bf16 if quantized_experts else 0.0
    dense_quantized = storage.quantized_params - (expert_params if quantized_experts else 0)
    dense_deq = copies * 2.0 * max(0, min(dense_quantized, dense_params))
    kernel_experts = expert_params * arch.experts_per_token / arch.num_experts \
        if fused and moe and quantized_experts and not expert_copies else 0.0
    kernel_params = max(0, min(dense_quantized, dense_params)) if fused else 0.0
    return WeightReads(dense=max(dense_stored, 0.0) + dense_deq, per_expert=per_expert_stored + expert_deq,
                       experts_held=layout.experts_per_rank, moe_layers=moe, num_experts=arch.num_experts,
                       top_k=arch.experts_per_token, group=layout.expert_parallel if layout.expert_parallel_on else 1,
                       kernel_params=kernel_params, kernel_expert_params=kernel_experts)


def kv_bytes_per_token(profile, arch: ArchSpec) -> float:
    """KV-cache bytes one cached token keeps, every layer (kv_dtype fp8: 1 byte an element and its scales, else 2)."""
    return arch.num_layers * arch.kv_bytes_per_token_layer(profile.rollout.kv_dtype)


def _split(profile, layout: Layout, ring_bytes: float, a2a_bytes: float) -> tuple[float, float]:
    """(intra-node, inter-node) bytes: ring collectives over all ranks cross nodes when there are several
    (the NIC is their slowest hop); an expert group's all-to-all crosses for its peers on other nodes."""
    gpn, nodes = profile.hardware.gpus_per_node, profile.hardware.nodes
    intra, inter = (0.0, ring_bytes) if nodes > 1 else (ring_bytes, 0.0)
    p = layout.expert_parallel
    remote = max(0, p - gpn) / (p - 1) if p > 1 else 0.0
    return intra + a2a_bytes * (1 - remote), inter + a2a_bytes * remote


def step_time(profile, arch: ArchSpec, storage: BaseStorage, layout: Layout, comm: Communication,
              adapter_bytes: float = 0.0, eff: Efficiency = Efficiency(), peaks: Peaks | None = None,
              adapters=None) -> StepTime:
    """The three phases of one RL step per GPU (docs/plan.md, "Time per RL step"); ``peaks`` replaces the
    catalog's (``plan --measure-time`` passes the rates it measured, with efficiency 1); ``adapters`` (plan.adapters'
    AdapterPlan) adds the adapters' matmuls, ops and optimizer step."""
    peaks = peaks or peaks_of(profile, eff)
    shape, world, ro = comm.shape, profile.world_size, profile.rollout
    reads = weight_reads(arch, storage, layout)  # the backward dequantizes, whatever the forward's kernel
    fused = fused_int4(profile.quant, profile.hardware.gpu)
    forward_reads = weight_reads(arch, storage, layout, fused=fused, experts_fused=experts_fused(
        fused, grouped_experts(profile, adapters), profile.hardware.gpu))
    active = arch.params_active
    terms = comm.terms
    counts = op_counts(profile, arch, adapters)
    lora = adapter_active_params(arch, adapters)
    # the elementwise ops' activation traffic: counted on the CPU, where it is the time of a small model; left out
    # on a GPU (docs/plan.md: decode's activations are batch x hidden, small against the weights, and L2-resident)
    act = activation_bytes_per_token(profile, arch, adapters) if peaks.synchronous else 0.0

    def hit(tokens: float) -> float:
        """Experts a forward of ``tokens`` tokens hits, summed over the MoE layers (of the E/P held under expert
        parallelism, whose tokens come from all P ranks)."""
        return reads.experts_held * touched_experts(arch.num_experts, arch.experts_per_token, tokens * reads.group) \
            / max(arch.num_experts, 1) * arch.moe_layers

    def ops(tokens: float) -> float:
        """Ops of one forward of ``tokens`` tokens: the dense part and the experts they hit."""
        return counts.forward(hit(tokens))

    # ---- rollout: per round one prefill of the prompts, then max_new_tokens x max_turns sampling steps, each but a
    # turn's last feeding its token back through the model (a decode forward)
    batch = min(rollout_batch(profile, shape.tokens_per_micro_batch // profile.memory.seq_len), shape.sequences)
    prompt, new, steps = prompt_tokens(profile), decoded_tokens(profile), decode_forwards(profile)
    rounds = shape.rollout_rounds
    kv = kv_bytes_per_token(profile, arch)
    intra, inter = _split(profile, layout, terms["zero3_gather_rollout"], terms["all_to_all_rollout"])
    first = 1 / shape.rollout_forwards  # the prefill's share of the per-forward traffic
    rows = prefill_rows(profile, batch)  # a group's prompt is prefilled once, its cache copied to each sequence
    prefill = _timed(PhaseTime(
        flops=rounds * (2.0 * (active + lora) * rows * prompt + attention_flops(arch, rows * prompt, prompt / 2)),
        hbm_bytes=rounds * (forward_reads.bytes(rows * prompt) + rows * prompt * act + batch * prompt * kv),
        intra_bytes=intra * first, inter_bytes=inter * first, tokens=0,
        ops=rounds * (ops(rows * prompt) + OPS_SAMPLE), items=rounds * attention_blocks(arch, rows),
        adapter_flops=rounds * 2.0 * lora * rows * prompt,
        kernel_work=forward_reads.kernel_work(rows * prompt, rounds)),
        peaks, eff)
    # graphed decode (orbitctl.model.graph_decode): a batch's first steps eager, every later one a replay of its
    # kernels; attention runs over the static cache's whole length, its unwritten slots masked
    graphs = comm.decode_graphs
    eager = min(steps, GRAPH_EAGER_STEPS) if graphs else steps
    step_ops = ops(batch) + counts.decode_extra
    context = prompt + new - 1 if graphs else prompt + (new + 1) / 2
    decode = _timed(PhaseTime(
        flops=rounds * steps * (2.0 * (active + lora) * batch + attention_flops(arch, batch, context, decode=True)),
        hbm_bytes=rounds * steps * (forward_reads.bytes(batch) + batch * context * kv + batch * act),
        intra_bytes=intra * (1 - first), inter_bytes=inter * (1 - first), tokens=shape.decode_tokens * world,
        ops=rounds * (eager * step_ops + (steps - eager) * OPS_GRAPH_STEP + new * OPS_SAMPLE),
        graph_kernels=rounds * (steps - eager) * step_ops * GRAPH_KERNELS_PER_OP,
        items=rounds * steps * attention_blocks(arch, batch),
        adapter_flops=rounds * steps * 2.0 * lora * batch,
        kernel_work=forward_reads.kernel_work(batch, rounds * steps)),
        peaks, eff)
    if not peaks.synchronous:  # a CPU's ops already wait for each other; a GPU's decode waits for its host each step
        lockstep = LOCKSTEP_S if layout.expert_parallel_on and layout.expert_parallel > 1 else 0.0
        decode.host_s = rounds * steps * (HOST_SYNC_S + lockstep + batch * KEYED_DRAW_S)
    rollout = PhaseTime(flops=prefill.flops + decode.flops, hbm_bytes=prefill.hbm_bytes + decode.hbm_bytes,
                        intra_bytes=intra, inter_bytes=inter, tokens=shape.decode_tokens * world,
                        ops=prefill.ops + decode.ops, items=prefill.items + decode.items,
                        graph_kernels=decode.graph_kernels,
                        adapter_flops=prefill.adapter_flops + decode.adapter_flops,
                        kernel_work=prefill.kernel_work + decode.kernel_work)
    _timed(rollout, peaks, eff)  # its floor from the totals; its terms and seconds are the sub-phases' sums
    rollout.compute_s = prefill.compute_s + decode.compute_s
    rollout.memory_s = prefill.memory_s + decode.memory_s
    rollout.overhead_s = prefill.overhead_s + decode.overhead_s
    rollout.host_s = prefill.host_s + decode.host_s
    rollout.parts = {"prefill": prefill, "decode": decode}

    # ---- policy update: forward, recompute and backward of every micro-batch, plus the no-grad forwards
    seq = profile.memory.seq_len
    t = min(shape.tokens_per_micro_batch // seq, shape.sequences) * seq  # a micro-batch is no larger than the rank's share
    linear, attn = 2.0 * active * t, attention_flops(arch, t, seq / 2)
    forward = linear + attn + 2.0 * lora * t
    # the backward (and a checkpointed layer's recompute) reaches down to the first adapted layer only
    first = adapters.first_layer if adapters is not None else 0
    reach, reach_layers = backward_reach(arch, first), (arch.num_layers - first) / arch.num_layers
    # frozen base: input gradients only (no weight-gradient GEMM); attention 2x; the adapters both gradients
    backward = reach * linear + 2 * reach_layers * attn + 4.0 * lora * t
    # memory.keep_frozen_outputs: the recompute takes the frozen matmuls' outputs the forward kept, reading no weight
    keep = profile.memory.keep_frozen_outputs
    recompute = (0.0 if keep else reach * linear) + reach_layers * attn + 2.0 * lora * t
    forward_passes = shape.micro_batches * (1 + (0 if keep else reach * shape.recompute)) + shape.no_grad_passes
    passes = forward_passes + shape.micro_batches * reach
    intra, inter = _split(profile, layout, terms["zero3_gather_train"] + terms["adapter_allreduce"],
                          terms["all_to_all_train"])
    fwd_ops, fwd_items = ops(t), attention_blocks(arch, t / seq)
    update = _timed(PhaseTime(
        flops=shape.micro_batches * (forward + recompute * shape.recompute + backward) + shape.no_grad_passes * forward,
        hbm_bytes=forward_passes * forward_reads.bytes(t) + shape.micro_batches * reach * reads.bytes(t)
        + passes * t * act, intra_bytes=intra, inter_bytes=inter,
        tokens=shape.micro_batches * t * world,
        ops=shape.micro_batches * (fwd_ops * (1 + reach * (shape.recompute + BACKWARD_OPS))
                                   + reach * counts.backward_extra(hit(t)) + OPS_LOSS)
        + shape.no_grad_passes * fwd_ops + shape.optimizer_steps * OPS_OPTIMIZER * counts.trainable_tensors,
        # the attention backward loops over the same items twice (dq, then dk and dv)
        items=(shape.micro_batches * (1 + reach_layers * (shape.recompute + 2)) + shape.no_grad_passes) * fwd_items,
        adapter_flops=(shape.micro_batches * (2 + 2 * shape.recompute + 4) + 2 * shape.no_grad_passes) * lora * t,
        # the forward passes' frozen matmuls run the fused kernel; the backward dequantizes (the GEMM's rate)
        kernel_work=forward_reads.kernel_work(t, forward_passes)),
        peaks, eff)

    # ---- adapter sync: a separate engine receives the whole adapter once per step; the shared one nothing
    sync_bytes = adapter_bytes if ro.engine == "separate" else 0.0
    intra, inter = _split(profile, layout, sync_bytes, 0.0)
    sync = _timed(PhaseTime(flops=0, hbm_bytes=0, intra_bytes=intra, inter_bytes=inter, tokens=0), peaks, eff)
    return StepTime({"rollout": rollout, "policy_update": update, "adapter_sync": sync}, world,
                    profile.hardware.nodes, eff, steps=rl_steps(profile),
                    price_per_gpu_hour=profile.hardware.price_per_gpu_hour)


def backward_reach(arch: ArchSpec, first_layer: int) -> float:
    """Share of a forward's matmul work the update's backward runs again (input gradients, a checkpointed layer's
    recompute): the layers from ``first_layer`` (the first adapted one) up and the output layer; 1 from layer 0."""
    if first_layer == 0:
        return 1.0
    share = arch.experts_per_token / arch.num_experts if arch.num_experts else 1.0
    reached = sum(w.numel * (share if w.kind == EXPERT else 1.0) for layer in arch.layers[first_layer:]
                  for w in layer.weights if w.parameter)
    output = arch.lm_head or arch.embedding  # a tied model's output layer is its embedding
    return min(1.0, (reached + output.numel + arch.final_norm.numel) / arch.params_active)


def rl_steps(profile) -> int:
    """RL steps of the run: rl.steps optimizer steps, ppo_epochs x minibatches of them per rollout batch."""
    return -(-profile.rl.steps // (profile.rl.ppo_epochs * profile.rl.minibatches))


def cost_text(usd: float | None) -> str:
    """'$1,234', '$12.3', '$0.042'; '-' without a price."""
    if usd is None:
        return "-"
    return f"${usd:,.0f}" if usd >= 1000 else f"${usd:.3g}"


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
