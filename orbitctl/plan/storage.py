"""How the frozen base is stored: bytes per weight of each quantized format, what is sharded.

Bits per weight include the format's metadata (scales, absmax). bitsandbytes keeps its
quantization state outside the parameter tensors, so ZeRO-3 cannot shard it: it is counted
replicated on every rank. compressed-tensors INT4 and FP8 keep their scales as ordinary
tensors, sharded like the weights. Every category is also split into the routed experts and
the dense rest (attention, shared experts, dense layers, embeddings, lm_head, norms, router):
expert parallelism places the first, ``memory.dense_layout`` the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from orbitctl.arch.spec import EMBEDDING, EXPERT, LM_HEAD, ROUTER, ArchSpec, Weight
from orbitctl.units import DTYPE_BYTES

FP8_BLOCK = 128 * 128


@dataclass(frozen=True)
class Format:
    """Bits per weight a quantized format stores, split into sharded and replicated parts."""

    name: str
    data_bits: float
    """Packed weight bits plus metadata stored in sharded tensors."""
    replicated_bits: float = 0.0
    """Metadata every rank keeps whole (bitsandbytes quant_state)."""
    shardable: bool = True
    """False when ZeRO-3 cannot partition the packed tensor (bnb with uint8 storage)."""

    @property
    def bits(self) -> float:
        return self.data_bits + self.replicated_bits


def quant_format(quant) -> Format:
    """The Format of a profile's ``quant`` section."""
    g = quant.group_size
    if quant.format == "int4":  # compressed-tensors pack-quantized, symmetric: bf16 scale per group
        return Format("int4", 4 + 16 / g)
    if quant.format in ("nf4", "fp4"):
        # absmax per block (fp32), or with double quant 8-bit absmax + an fp32 scale per 256 blocks
        meta = 8 / g + 32 / (g * 256) if quant.double_quant else 32 / g
        return Format(quant.format, 4, replicated_bits=meta, shardable=quant.storage_dtype == "bf16")
    if quant.format == "fp8":  # e4m3 with an fp32 scale per 128x128 block
        return Format("fp8", 8 + 32 / FP8_BLOCK)
    return Format("none", 16)


def is_quantized(weight: Weight, quant) -> bool:
    """Whether the quant section stores this weight quantized (router, norms, embeddings never)."""
    if quant.format == "none" or not weight.linear or weight.kind in (ROUTER, EMBEDDING):
        return False
    if quant.modules == "experts" and weight.kind != EXPERT:
        return False
    name = LM_HEAD if weight.kind == LM_HEAD else weight.name
    return not any(skip and skip in name for skip in quant.skip)


@dataclass(frozen=True)
class BaseStorage:
    """Total stored bytes of the frozen base, by how ZeRO can place them."""

    quantized_params: int
    plain_params: int
    sharded_bytes: float
    """Bytes ZeRO-3 partitions across ranks (packed weights, sharded scales, bf16 weights)."""
    unshardable_bytes: float
    """Packed weights ZeRO-3 cannot partition (bitsandbytes uint8 storage): whole on every rank."""
    replicated_bytes: float
    """Quantization metadata every rank keeps whole whatever the ZeRO stage (bnb quant state)."""
    layer_bytes: tuple[float, ...]
    """Stored bytes of each decoder layer (all experts), the ZeRO-3 gather unit."""
    layer_expert_bytes: tuple[float, ...]
    """The routed-expert part of each layer: under expert parallelism never gathered."""
    embedding_bytes: float
    lm_head_bytes: float
    largest_dequant_bytes: int
    """bf16 size of the largest single quantized matrix (one expert's, not the stack)."""
    layer_expert_bf16_bytes: int
    """bf16 size of one MoE layer's routed experts, all of them: what a stacked dequant builds."""
    expert_sharded_bytes: float
    """The routed experts' part of ``sharded_bytes`` (every MoE layer, all experts)."""
    expert_unshardable_bytes: float
    """The routed experts' part of ``unshardable_bytes``."""
    expert_replicated_bytes: float
    """The routed experts' part of ``replicated_bytes`` (their bnb quant state)."""

    @property
    def total_bytes(self) -> float:
        return self.sharded_bytes + self.unshardable_bytes + self.replicated_bytes

    @property
    def expert_bytes(self) -> float:
        """All routed experts of every MoE layer in their stored format, metadata included."""
        return self.expert_sharded_bytes + self.expert_unshardable_bytes + self.expert_replicated_bytes

    @property
    def dense_sharded_bytes(self) -> float:
        return self.sharded_bytes - self.expert_sharded_bytes

    @property
    def dense_unshardable_bytes(self) -> float:
        return self.unshardable_bytes - self.expert_unshardable_bytes

    @property
    def dense_replicated_bytes(self) -> float:
        return self.replicated_bytes - self.expert_replicated_bytes


def base_storage(arch: ArchSpec, quant, model_dtype: str = "bf16") -> BaseStorage:
    fmt = quant_format(quant)
    plain_dtype_bytes = DTYPE_BYTES[model_dtype]
    cache: dict[int, tuple] = {}

    def weight_bytes(w: Weight) -> tuple[float, float, float, int, int]:
        """(sharded, unshardable, replicated metadata, quantized params, plain params) of one weight."""
        if not w.parameter:
            return 0.0, 0.0, 0.0, 0, 0
        if is_quantized(w, quant):
            data = w.numel * fmt.data_bits / 8
            meta = w.numel * fmt.replicated_bits / 8
            return (data, 0.0, meta, w.numel, 0) if fmt.shardable else (0.0, data, meta, w.numel, 0)
        nbytes = DTYPE_BYTES.get(w.dtype or "", plain_dtype_bytes)
        return float(w.numel * nbytes), 0.0, 0.0, 0, w.numel

    def layer_totals(weights: tuple[Weight, ...]):
        key = id(weights)
        if key not in cache:
            totals = [0.0, 0.0, 0.0, 0, 0]
            experts, dequant = [0.0, 0.0, 0.0], 0
            for w in weights:
                parts = weight_bytes(w)
                totals = [a + b for a, b in zip(totals, parts)]
                if w.kind == EXPERT:
                    experts = [a + b for a, b in zip(experts, parts[:3])]
                if parts[3]:
                    dequant = max(dequant, 2 * w.numel // w.copies)
            stacked = sum(2 * w.numel for w in weights if w.kind == EXPERT)
            cache[key] = (totals, experts, dequant, stacked)
        return cache[key]

    totals = [0.0, 0.0, 0.0, 0, 0]
    expert_totals = [0.0, 0.0, 0.0]
    dequant = stacked = 0
    layer_bytes, layer_experts = [], []
    for layer in arch.layers:
        parts, experts, d, st = layer_totals(layer.weights)
        totals = [a + b for a, b in zip(totals, parts)]
        expert_totals = [a + b for a, b in zip(expert_totals, experts)]
        dequant, stacked = max(dequant, d), max(stacked, st)
        layer_bytes.append(sum(parts[:3]))
        layer_experts.append(sum(experts))
    globals_bytes = {}
    for w in arch.global_weights:
        parts = weight_bytes(w)
        totals = [a + b for a, b in zip(totals, parts)]
        globals_bytes[w.kind] = sum(parts[:3])
        if parts[3]:
            dequant = max(dequant, 2 * w.numel)
    sharded, unshardable, replicated, quantized, plain = totals
    return BaseStorage(
        quantized_params=int(quantized), plain_params=int(plain), sharded_bytes=sharded,
        unshardable_bytes=unshardable, replicated_bytes=replicated,
        layer_bytes=tuple(layer_bytes), layer_expert_bytes=tuple(layer_experts),
        embedding_bytes=globals_bytes.get(EMBEDDING, 0.0), lm_head_bytes=globals_bytes.get(LM_HEAD, 0.0),
        largest_dequant_bytes=dequant, layer_expert_bf16_bytes=stacked,
        expert_sharded_bytes=expert_totals[0], expert_unshardable_bytes=expert_totals[1],
        expert_replicated_bytes=expert_totals[2],
    )
