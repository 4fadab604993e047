"""Operators one eager forward issues, counted from the architecture: the per-op overhead term of the time model.

Eager PyTorch issues one operator (a CPU kernel call, or one CUDA kernel launch) per tensor op,
whatever its size. On a 1 T-parameter GPU model the ops are wide and their count does not
matter; on a hidden-64 CPU model they are a few hundred elements each and the count *is* the
time. The counts below are the ops orbitctl's own modules issue (transformers' decoder layers,
PEFT's LoRA, bitsandbytes' and ``QuantLinear``'s dequantization, ``QuantExperts``' loop over
the experts a batch hits), read from the code paths; docs/plan.md ("Per-op overhead") gives
them with the check against a TorchDispatchMode count of the tiny profiles. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from orbitctl.arch.spec import EXPERT, ROUTER, ArchSpec
from orbitctl.plan.memo import Same, Values
from orbitctl.plan.storage import is_quantized

OPS_NORM = 8
"""RMSNorm: cast to fp32, pow, mean, add eps, rsqrt, mul, cast back, mul by the weight."""
OPS_LINEAR = 3
"""F.linear of a 3-D input: transpose, mm, view."""
OPS_DEQUANT = {"nf4": 6, "fp4": 6, "int4": 12, "fp8": 5, "none": 0}
"""Extra ops of a quantized linear: bitsandbytes' blockwise + 4-bit dequantization (with double-quant absmax);
QuantLinear's INT4 unpack (shift, mask, offset, cast, scale per group, reshape); FP8 cast and block scale."""
OPS_INT4_FUSED = 5
"""A whole INT4 linear through the fused CPU kernel (quant.kernel): view, cast to bf16, the kernel, cast back, view."""
OPS_LORA = 10
"""PEFT LoRA on one linear: dropout (identity), two linears, scaling, add, input cast."""
OPS_ATTENTION = {"gqa": 30, "mla": 40}
"""Between the projections: views and transposes, RoPE on q and k, the KV-cache concatenation, repeat_kv, the
attention kernel, the output reshape (MLA: the latent split, the rope/nope split and concatenation)."""
OPS_MLA_DECODE = 18
"""An MLA layer's decode step on the cached latent (orbitctl.model.mla) beyond OPS_ATTENTION["mla"]: the absorbed
up-projections (two batched matmuls and their views), the split score matmuls and their sum, the mask."""
OPS_MLP = 2
"""SwiGLU: the activation and the product."""
OPS_RESIDUAL = 2
OPS_ROUTER = 10
"""Router in fp32: cast, gate linear, sigmoid/softmax, bias, top-k, gather, normalise, scale."""
OPS_EXPERT_DISPATCH = 14
"""Once per MoE layer (orbitctl.model.expert_lora.experts_by_row): the slots sorted by expert (argsort, index,
unique_consecutive), the tokens gathered, split into one run per expert and the runs concatenated, the top-k
weights gathered and applied, one index_add into the zeroed output."""
OPS_GROUPED_EXPERTS = 40
"""Once per MoE layer whose routed experts run grouped (orbitctl.kernels.grouped_int4, an NVIDIA GPU): the slots sorted
into padded blocks by expert (align_blocks: 24 ops of static shapes), the activations cast, the two kernel launches
(gate and up as one, down) with their outputs, the activation, its product, the weighted sum over the top-k slots."""
OPS_GROUPED_BACKWARD = 40
"""Per hit expert in the backward of a grouped layer: for each of its two projections the expert's slots found
(eq, nonzero), its weight dequantized, the input gradient's matmul and its index_add."""
OPS_GATE_UP_SPLIT = 2
"""On the CPU with the fused kernel, an expert's gate and up run as one kernel call over a shared pack
(orbitctl.model.quant_linear.ExpertMLP.gate_up): in place of up's own call, the two slices of the result."""
OPS_EXPERT = 0
"""One hit expert besides its three linears and its activation: nothing (its rows are a view of the split)."""
OPS_CPU_ROWS = 2
"""On the CPU, one hit expert's rows padded to the matmul row grid and the padding sliced off (expert_lora.cpu_rows)."""
OPS_MODEL = 30
"""Once per forward: embedding, positions, the attention mask, the final norm, the lm_head's cast and views."""
OPS_SAMPLE = 15
"""Once per decoded step: temperature, softmax, draw, log-prob gather, appending the token."""
OPS_LOSS = 150
"""Once per micro-batch: log-softmax, gathers, ratio, clip, IS correction, align KL, the statistics."""
OPS_OPTIMIZER = 12
"""Per trainable tensor per optimizer step: gradient norm, clip, AdamW's moments, update."""
OPS_BOTTLENECK = 2 * OPS_LINEAR + 2
"""The bottleneck adapter after a layer's MLP: down and up linears, relu, the residual add."""
BACKWARD_OPS = 2.0
"""Backward ops per forward op: autograd's node for each op computes one or two gradient ops, plus the accumulation."""


@dataclass(frozen=True)
class OpCounts:
    """Ops of one forward, split into what every token passes and what each hit routed expert adds."""

    dense: float
    """Ops of the layers' dense part and the model's once-per-forward ops."""
    per_expert: float
    """Ops one hit routed expert of one MoE layer adds (its three projections and the loop's bookkeeping)."""
    trainable_tensors: int
    """Trainable tensors the optimizer steps (LoRA: A and B of each adapted module, bottleneck: four per layer)."""
    decode_extra: float = 0.0
    """Ops a one-token decode forward issues beyond :meth:`forward`'s (MLA attention on the cached latent)."""
    backward_per_expert: float = 0.0
    """Ops one hit routed expert adds to the backward beyond BACKWARD_OPS x its forward ops: the grouped layers'
    dequantizing backward (their forward has no per-expert ops)."""

    def forward(self, experts_hit: float) -> float:
        """Ops of one forward in which ``experts_hit`` routed experts run, summed over the MoE layers."""
        return self.dense + self.per_expert * experts_hit

    def backward_extra(self, experts_hit: float) -> float:
        """Ops the backward of such a forward issues besides BACKWARD_OPS x its forward ops."""
        return self.backward_per_expert * experts_hit


def fused_int4(quant, gpu: str) -> bool:
    """Whether the INT4 layers run the fused kernel: quant.kernel auto or fused on the CPU or an NVIDIA GPU
    (orbitctl.kernels.int4_kernel; auto where its rows probe independent, as they do on the kernels measured)."""
    from orbitctl.profile.gpus import resolve_gpu

    return quant.format == "int4" and quant.kernel != "dequantize" and resolve_gpu(gpu).vendor in ("cpu", "nvidia")


def experts_fused(fused: bool, grouped: bool, gpu: str) -> bool:
    """Whether the routed experts' forward reads their 4-bit codes once: the CPU's fused kernel, or a GPU's grouped
    kernel; a GPU's ungrouped experts dequantize (orbitctl.model.frozen_base.use_fused_int4)."""
    from orbitctl.profile.gpus import resolve_gpu

    return fused and (grouped or resolve_gpu(gpu).vendor == "cpu")


OPS_GRAPH_STEP = 4
"""Eager ops around one replayed decode step (orbitctl.model.graph_decode.StaticDecode): the token copied in, the mask
column opened, the position advanced, the replay."""
GRAPH_KERNELS_PER_OP = 0.55
"""Kernels a replayed graph runs per op the same step dispatches eagerly: views, reshapes and empty allocations
launch nothing (a tiny-MoE decode step on the static cache: 0.54-0.58 of its ops launch a kernel, with either
kernel and compute dtype)."""
GRAPH_EAGER_STEPS = 2
"""Decode steps of a batch that run eagerly before its graph replays: the warm-up and the captured one."""


def decode_graphs(profile, *, moe: bool, grouped: bool, gathered: bool) -> bool:
    """Whether the rollout's decode steps replay a CUDA graph (orbitctl.model.graph_decode): rollout.decode_graphs
    true or auto, a GPU, orbitctl's own infer path (rollout.engine shared) with a bf16 KV cache, and a step the host
    never reads a value of: nothing ZeRO-3 gathers while decoding (``gathered``), and on an MoE (``moe``) the routed
    experts grouped (``grouped``; the per-expert loop reads the routing on the host)."""
    from orbitctl.profile.gpus import resolve_gpu

    ro = profile.rollout
    if ro.decode_graphs is False or ro.engine != "shared" or ro.kv_dtype != "bf16":
        return False
    return resolve_gpu(profile.hardware.gpu).vendor != "cpu" and not gathered and (grouped or not moe)


def grouped_experts(profile, adapters=None) -> bool:
    """Whether the routed experts run as grouped INT4 kernels (orbitctl.kernels.grouped_int4): the fused kernel on an
    NVIDIA GPU, INT4 experts, no per-expert adapter factors, and experts ZeRO-3 does not partition (expert parallelism,
    or a lower ZeRO stage)."""
    from orbitctl.profile.gpus import resolve_gpu

    if not fused_int4(profile.quant, profile.hardware.gpu) or resolve_gpu(profile.hardware.gpu).vendor != "nvidia":
        return False
    if getattr(adapters, "expert_layout", "none") not in ("none", "shared"):
        return False
    return profile.memory.zero_stage != 3 or profile.memory.expert_parallel > 1


def _linear_ops(weight, quant, adapted: bool, fused: bool = False) -> float:
    lora = OPS_LORA if adapted else 0
    if not is_quantized(weight, quant):
        return OPS_LINEAR + lora
    return (OPS_INT4_FUSED if fused else OPS_LINEAR + OPS_DEQUANT[quant.format]) + lora


def op_counts(profile, arch: ArchSpec, adapters=None) -> OpCounts:
    """The ops of one forward of ``arch`` as ``profile`` stores and adapts it (``adapters``: an AdapterPlan).

    Counted once per architecture, adapter plan, quant section and GPU: a plan evaluates the same ones many
    times (the micro-batch search, the re-plans of the advice and layouts), and the count visits every weight."""
    grouped = arch.is_moe and grouped_experts(profile, adapters)
    return _op_counts(Same(arch), Same(adapters), Values(profile.quant), profile.hardware.gpu, grouped)


@lru_cache(maxsize=64)
def _op_counts(arch_key: Same, adapters_key: Same, quant_key: Values, gpu: str, grouped: bool = False) -> OpCounts:
    from orbitctl.profile.gpus import resolve_gpu

    arch, adapters, quant = arch_key.obj, adapters_key.obj, quant_key.section
    adapted = adapters.adapted if adapters is not None else frozenset()
    dense = float(OPS_MODEL + OPS_NORM)  # + the final norm
    per_expert = 0.0
    mla = arch.attention == "mla"
    fused = fused_int4(quant, gpu)
    dispatch = OPS_GROUPED_EXPERTS if grouped else OPS_EXPERT_DISPATCH
    expert_fused = experts_fused(fused, grouped, gpu)
    for layer in arch.layers:
        dense += OPS_NORM * (2 + (2 if mla else 0)) + OPS_ATTENTION["mla" if mla else "gqa"] + OPS_RESIDUAL
        dense += OPS_MLP if not layer.moe else (OPS_ROUTER + dispatch + (OPS_MLP if arch.shared_intermediate_size else 0))
        for w in layer.weights:
            if not w.linear:
                continue
            ops = _linear_ops(w, quant, (layer.index, w.name) in adapted, expert_fused if w.kind == EXPERT else fused)
            if w.kind == EXPERT and expert_fused and not grouped and w.name.endswith("up_proj") \
                    and (layer.index, w.name) not in adapted:
                per_expert += OPS_GATE_UP_SPLIT  # the CPU kernel runs gate and up as one call (ExpertMLP.gate_up)
            elif w.kind == EXPERT:
                per_expert += ops  # one projection of one expert; summed over the MoE layers
            elif w.kind != ROUTER:
                dense += ops
    if arch.is_moe:  # per hit expert of one MoE layer (+ adapter.experts' LoRA on its three projections)
        per_expert = per_expert / max(arch.moe_layers, 1) + OPS_EXPERT + OPS_MLP
        if resolve_gpu(gpu).vendor == "cpu":
            per_expert += OPS_CPU_ROWS
        if getattr(adapters, "expert_layout", "none") != "none":
            per_expert += 3 * OPS_LORA
    backward_per_expert = 0.0
    if grouped:  # one launch per projection whatever the experts hit (a shared expert adapter: 3 LoRAs per layer)
        dense += arch.moe_layers * (3 * OPS_LORA if getattr(adapters, "expert_layout", "none") == "shared" else 0)
        per_expert, backward_per_expert = 0.0, OPS_GROUPED_BACKWARD
    if arch.lm_head is not None:
        dense += OPS_LINEAR
    if adapters is not None and adapters.kind == "bottleneck":
        dense += OPS_BOTTLENECK * arch.num_layers
    if adapters is None:
        tensors = 0
    elif adapters.kind == "bottleneck":
        tensors = 4 * arch.num_layers
    else:
        tensors = 2 * len(adapted)
    return OpCounts(dense=dense, per_expert=per_expert, trainable_tensors=tensors, backward_per_expert=backward_per_expert,
                    decode_extra=OPS_MLA_DECODE * arch.num_layers if mla else 0.0)


def attention_blocks(arch: ArchSpec, sequences: float) -> float:
    """Work items of one attention call on the CPU: one per (sequence, head) (ATen's CPU flash kernel loops over
    them one block at a time), summed over the layers. A GPU kernel is one launch whatever the batch."""
    return arch.num_layers * arch.num_heads * sequences


def activation_bytes_per_token(profile, arch: ArchSpec, adapters=None) -> float:
    """Bytes the elementwise ops of one forward read and write per token, every layer: each op reads its input
    and writes its output once (2 passes of its width). RMSNorm works in fp32; the rest in the compute dtype.
    Computed once per architecture, adapter plan and element size, like ``op_counts``."""
    return _activation_bytes(Same(arch), Same(adapters), 4 if profile.quant.compute_dtype == "fp32" else 2)


@lru_cache(maxsize=64)
def _activation_bytes(arch_key: Same, adapters_key: Same, c: int) -> float:
    arch, adapters = arch_key.obj, adapters_key.obj
    h = arch.hidden_size
    adapted = adapters.adapted if adapters is not None else frozenset()
    if arch.attention == "mla":
        q = arch.num_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim)
        k = arch.num_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim)
    else:
        q, k = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    total = 0.0
    for layer in arch.layers:
        width = arch.moe_intermediate_size * arch.experts_per_token + arch.shared_intermediate_size \
            if layer.moe else arch.intermediate_size
        per = 2 * OPS_NORM * h * 4 * 2          # two norms in fp32, read + write
        per += 7 * (q + k) * c * 2              # RoPE on q and k: two products, rotate (slice, neg, cat), sum
        per += OPS_RESIDUAL * h * c * 3         # residual adds: two reads, one write
        per += 2 * width * c * 3                # activation and product of the MLP
        lora = sum(1 for w in layer.weights if w.linear and (layer.index, w.name) in adapted)
        per += lora * 2 * h * c * 3             # LoRA's scale and add on each adapted output
        total += per
    return total


def adapter_active_params(arch: ArchSpec, adapters=None) -> float:
    """Adapter parameters one token passes through: LoRA's r (d_in + d_out) of each adapted module (k/E of a routed
    expert's), the bottleneck's whole; their matmuls are 2 FLOPs per parameter per token, like the base's.
    Computed once per architecture and adapter plan, like ``op_counts``."""
    return _adapter_active_params(Same(arch), Same(adapters))


@lru_cache(maxsize=64)
def _adapter_active_params(arch_key: Same, adapters_key: Same) -> float:
    arch, adapters = arch_key.obj, adapters_key.obj
    if adapters is None:
        return 0.0
    if adapters.kind == "bottleneck":
        return float(adapters.trainable_params)
    total = 0.0
    for index, w in arch.linear_weights():
        if (index, w.name) in adapters.adapted:
            out_f, in_f = w.shape
            share = arch.experts_per_token / arch.num_experts if w.kind == EXPERT and arch.num_experts else 1.0
            total += adapters.rank * (in_f + out_f) * w.copies * share
    if arch.num_experts:  # adapter.experts: the routed experts' own adapters, k of E per token (an upper bound
        total += getattr(adapters, "expert_params", 0) * arch.experts_per_token / arch.num_experts  # when shared)
    return total
