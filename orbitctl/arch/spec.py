"""ArchSpec: every weight matrix of a decoder-only transformer, with its shape and kind.

The planner reads parameter counts, the largest ZeRO-3 gather unit, the linear modules
adapters can target and the per-token KV-cache size from here. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import prod

# Weight kinds. "expert" is a routed expert; only k of num_experts are active per token.
EMBEDDING, LM_HEAD, NORM, ATTENTION, MLP = "embedding", "lm_head", "norm", "attention", "mlp"
EXPERT, SHARED_EXPERT, ROUTER, BIAS = "expert", "shared_expert", "router", "bias"
KINDS = (EMBEDDING, ATTENTION, MLP, EXPERT, SHARED_EXPERT, ROUTER, NORM, BIAS, LM_HEAD)


@dataclass(frozen=True)
class Weight:
    """One named weight of a layer (or of the model), possibly stacked over routed experts."""

    name: str
    """Module path inside its layer, e.g. 'self_attn.q_proj' or 'mlp.experts.down_proj'."""
    kind: str
    shape: tuple[int, ...]
    """(out_features, in_features) for a linear weight, (n,) for a norm or bias."""
    copies: int = 1
    """Routed experts stored side by side (one matrix per expert)."""
    linear: bool = False
    """A matmul weight: can be quantized and adapted."""
    parameter: bool = True
    """False for state a checkpoint stores but the model keeps as a buffer (router score bias)."""
    dtype: str | None = None
    """Dtype the model keeps this weight in when it differs from the model dtype (fp32 router)."""

    @property
    def numel(self) -> int:
        return self.copies * prod(self.shape)

    @property
    def suffix(self) -> str:
        """Last name component, the handle adapter targets use ('q_proj')."""
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its index, whether its MLP is a mixture of experts, and its weights."""

    index: int
    moe: bool
    weights: tuple[Weight, ...]

    @cached_property
    def params(self) -> int:
        return sum(w.numel for w in self.weights if w.parameter)


@dataclass(frozen=True)
class ArchSpec:
    """A model's shapes and counts, parsed from a Hugging Face config.json.

    The counts are cached on first use: a spec never changes, and the planner reads them in every one of the
    evaluations of a plan (the micro-batch search, the advice and layout re-plans)."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str
    """'gqa' (multi-head and grouped-query) or 'mla' (DeepSeek multi-head latent attention)."""
    intermediate_size: int
    layers: tuple[Layer, ...]
    embedding: Weight
    final_norm: Weight
    lm_head: Weight | None
    """None when tied to the embedding."""
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    """Width of the always-active shared expert MLP (0 when the model has none)."""
    mtp_layers: int = 0
    """Next-token-prediction (MTP) layers in the checkpoint: excluded from every count."""
    mtp_params: int = 0
    max_position_embeddings: int = 0
    config: dict = field(default_factory=dict, repr=False, compare=False)

    # ---- counts ----------------------------------------------------------------------------
    @property
    def global_weights(self) -> tuple[Weight, ...]:
        return (self.embedding, self.final_norm) + ((self.lm_head,) if self.lm_head else ())

    def all_weights(self):
        """(layer index or None, weight) for every weight, layer by layer."""
        for w in self.global_weights:
            yield None, w
        for layer in self.layers:
            for w in layer.weights:
                yield layer.index, w

    @cached_property
    def params_by_kind(self) -> dict[str, int]:
        counts = dict.fromkeys(KINDS, 0)
        for _, w in self.all_weights():
            if w.parameter:
                counts[w.kind] += w.numel
        return counts

    @cached_property
    def params_total(self) -> int:
        return sum(self.params_by_kind.values())

    @cached_property
    def params_active(self) -> int:
        """Parameters one token passes through: k of the routed experts, everything else."""
        routed = self.params_by_kind[EXPERT]
        if not routed:
            return self.params_total
        return self.params_total - routed + routed * self.experts_per_token // self.num_experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @cached_property
    def moe_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.moe)

    @cached_property
    def largest_layer_params(self) -> int:
        """The largest decoder layer with all its experts: what ZeRO-3 gathers at once."""
        return max(layer.params for layer in self.layers)

    @cached_property
    def largest_module_params(self) -> int:
        """The largest single module's own weight (DeepSpeed's `largest_layer_params`)."""
        return max(w.numel for _, w in self.all_weights() if w.parameter and w.copies == 1)

    def linear_weights(self):
        """(layer index, weight) for every matmul weight in the decoder layers."""
        for layer in self.layers:
            for w in layer.weights:
                if w.linear:
                    yield layer.index, w

    # ---- inference -------------------------------------------------------------------------
    def kv_elements_per_token_layer(self) -> int:
        """KV-cache elements one token keeps per layer: MLA keeps the latent, GQA full K and V."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_layer(self, kv_dtype: str) -> float:
        """KV-cache bytes one token keeps per layer: bf16 2 bytes an element; fp8 1 byte an element plus one fp32
        scale per cached head of K and of V (GQA: 2 x kv heads; MLA: the latent and the rope key, one 'head' each),
        as the infer path's fp8 cache stores them (orbitctl.kernels.kv_cache)."""
        elements = self.kv_elements_per_token_layer()
        if kv_dtype != "fp8":
            return 2.0 * elements
        heads = 2 if self.attention == "mla" else 2 * self.num_kv_heads
        return elements + 4.0 * heads

    def summary(self) -> dict:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "layers": self.num_layers,
            "moe_layers": self.moe_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "attention": self.attention,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "params_by_kind": dict(self.params_by_kind),
            "mtp_layers": self.mtp_layers,
            "mtp_params": self.mtp_params,
        }
