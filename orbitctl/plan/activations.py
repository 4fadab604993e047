"""Training activations and logits, counted tensor by tensor from what autograd saves.

Per token, bytes, for a frozen BF16/quantized base with adapters (a frozen linear saves no
input, so only adapted modules keep theirs):

- RMSNorm (transformers upcasts to fp32 and keeps that copy): ``4h + 4``.
- Attention with a flash-style kernel: rotated q and k, v, the output, fp32 log-sum-exp:
  ``2ad_qk + 2gd_qk + 2gd_v + 2ad_v + 4a``; without it the fp32 softmax and its bf16 copy
  add ``6as`` and k/v are expanded to all heads.
- SwiGLU MLP: gate, up and silu(gate): ``6i``; the down input ``2i`` only when adapted.
- MoE: router scores, top-k and sort indices, then per routed copy the permuted input,
  gate/up output, silu output and expert output: ``k(4h + 6i_moe + 4) + 4E + 32k``.
- Adapters: the shared normed input ``2h`` once per block, the LoRA-A output ``2r`` per
  adapted module; dropout adds ``3 d_in`` (copy + mask) per module, fp32 adapters ``4 d_in``.
  The routed experts' own adapters (``adapter.experts``) keep ``a(h + i_moe + 3r)`` per routed
  copy (:func:`expert_adapter_saved`).

With per-layer checkpointing only each layer's bf16 input ``2h`` stays; backward then
recomputes one layer and holds its saved tensors plus the gradients of its block (about one
block's saved size; for MoE at least the routed copies' weighted-output gradients). Logits: the fp32 log-softmax output ``4V`` stays after the
forward and ``12V`` are live when the loss backward starts; a chunked loss bounds that to
the chunk. The no-grad log-prob passes RL adds (reference, old policy) peak at ``10V``.
"""

from __future__ import annotations

from dataclasses import dataclass

from orbitctl.arch.spec import ATTENTION, EXPERT, MLP, ROUTER, SHARED_EXPERT, ArchSpec, Layer
from orbitctl.plan.adapters import AdapterPlan


@dataclass(frozen=True)
class ActivationSettings:
    """What the activations depend on besides the architecture and the adapters: the micro-batch, the
    checkpointing and offload, the attention kernel, dropout, the adapters' dtype and the loss chunk."""

    tokens: int
    """Tokens in one micro-batch (micro_batch_size x seq_len)."""
    seq_len: int
    checkpointing: bool
    offload: bool
    flash: bool
    dropout: bool
    adapter_bytes: int
    loss_chunk: int
    """Tokens per lm_head + loss chunk; 0 for the whole micro-batch at once."""
    logit_positions: int = 0
    """Positions of the micro-batch that reach the output layer: the train path asks the model for the completion's
    logits only (``logits_to_keep``), so a short completion after a long prompt makes few; 0: every token."""
    act_bytes: int = 2
    """Bytes of one activation element, the compute dtype's (fp32 on a CPU without native bf16)."""
    keep_frozen: bool = False
    """``memory.keep_frozen_outputs``: each checkpointed layer also keeps its frozen matmuls' outputs."""


@dataclass(frozen=True)
class LayerActivations:
    """What one layer keeps for its backward and what its blocks' backward holds, in bytes per token."""

    saved: float
    """Bytes per token autograd keeps for this layer's backward."""
    attention_saved: float
    attention_block: float
    """Bytes per token live while the attention block's backward runs (its gradients)."""
    mlp_block: float
    """The same for the MLP/MoE block."""
    materialized: float = 0.0
    """Bytes (not per token) of bf16 expert weights an adapter on stacked experts builds."""

    def backward_peak(self) -> float:
        """Bytes per token at this layer's backward peak: backward runs the MLP first (everything
        saved plus the MLP's gradients), then attention (only attention's saved tensors left)."""
        return max(self.saved + self.mlp_block, self.attention_saved + self.attention_block)


@dataclass(frozen=True)
class TrainActivations:
    """Activation and logits bytes at the peak moment of one micro-batch's forward and backward."""

    activations: float
    logits: float
    saved_boundaries_host: float
    """Bytes of checkpoints offloaded to host RAM (per GPU)."""
    moment: str
    """Which moment of the step is the peak: 'loss backward', 'layer backward' or 'log-prob pass'."""


# modules whose input is the block's normed hidden state (the others read an inner tensor)
READS_NORMED = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "gate")


def _lora_inputs(arch: ArchSpec, layer: Layer, ad: AdapterPlan, kinds: tuple[str, ...], st: ActivationSettings) -> float:
    """Saved bytes per token that exist only because modules of these kinds are adapted."""
    modules = [w for w in layer.weights if w.linear and w.kind in kinds and ad.adapted_in(layer.index, w.name)]
    total = 0.0
    for w in modules:
        d_in, copies = w.shape[1], (arch.experts_per_token if w.kind == EXPERT else 1)
        total += copies * ad.rank * st.adapter_bytes  # LoRA-A output, input of B
        if st.dropout:
            total += copies * 3 * d_in
        if st.adapter_bytes == 4 and st.act_bytes != 4:
            total += copies * 4 * d_in  # the input cast up to the adapters' fp32
    # adapted modules reading the block's normed input share one saved copy of it (in the adapters' dtype when that
    # is the compute dtype: no cast in between)
    if not st.dropout and st.adapter_bytes == st.act_bytes and any(w.suffix in READS_NORMED for w in modules):
        total += st.act_bytes * arch.hidden_size
    return total


def _adapted(layer: Layer, ad: AdapterPlan, suffixes: tuple[str, ...], kinds: tuple[str, ...] | None = None) -> bool:
    return any(ad.adapted_in(layer.index, w.name) for w in layer.weights
               if w.suffix in suffixes and (kinds is None or w.kind in kinds))


def _attention_core(arch: ArchSpec, layer: Layer, ad: AdapterPlan, st: ActivationSettings) -> tuple[float, float]:
    """(saved bytes per token of the attention block without adapters and norm, of which its output)."""
    a, s = arch.num_heads, st.seq_len
    w = st.act_bytes / 2  # the bf16 terms below, in the compute dtype
    if arch.attention == "mla":
        qk, dv = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.v_head_dim
        # flash kernels need one head size: v (and so the output) is padded to the q/k size
        dv_kept = qk if st.flash else dv
        attn = w * (2 * a * qk * 2 + 2 * a * dv_kept * 2) + 4 * a
        if arch.q_lora_rank:
            attn += 4 * arch.q_lora_rank + 4 + (w * 2 * arch.q_lora_rank if _adapted(layer, ad, ("q_b_proj",)) else 0)
        attn += 4 * arch.kv_lora_rank + 4 + (w * 2 * arch.kv_lora_rank if _adapted(layer, ad, ("kv_b_proj",)) else 0)
        kv_heads, out = a, w * 2 * a * dv_kept
    else:
        d, g = arch.head_dim, arch.num_kv_heads
        attn = w * (2 * a * d + 2 * g * d + 2 * g * d + 2 * a * d) + 4 * a
        if arch.qk_norm:
            attn += 4 * (a + g) * d + 4 * (a + g)
        qk, dv, kv_heads, out = d, d, g, w * 2 * a * d
    if not st.flash:
        # eager: fp32 softmax kept for its backward, its bf16 copy for the value matmul,
        # and k/v expanded from kv_heads to every head
        attn += 6 * a * s + w * 2 * (a - kv_heads) * (qk + dv)
    return attn, out


def _mlp_core(arch: ArchSpec, layer: Layer, ad: AdapterPlan, act_bytes: int = 2) -> tuple[float, float, float]:
    """(saved bytes per token of the MLP/MoE block without adapters and norm, the part only an
    adapted down projection keeps, bf16 expert weights an expert adapter materialises)."""
    h, w = arch.hidden_size, act_bytes / 2  # the bf16 terms, in the compute dtype
    if not layer.moe:
        i = arch.intermediate_size
        return w * 6 * i, (w * 2 * i if _adapted(layer, ad, ("down_proj",), (MLP,)) else 0), 0.0
    k, e, im = arch.experts_per_token, arch.num_experts, arch.moe_intermediate_size
    router = (8 if arch.attention == "mla" else 4) * e  # sigmoid scores + biased copy for DeepSeek
    core = k * (4 * h + 6 * im + 4) + router + 32 * k
    down = k * 2 * im if _adapted(layer, ad, ("down_proj",), (EXPERT,)) else 0
    if arch.shared_intermediate_size:
        core += 6 * arch.shared_intermediate_size
        down += 2 * arch.shared_intermediate_size if _adapted(layer, ad, ("down_proj",), (SHARED_EXPERT,)) else 0
    # LoRA on stacked expert parameters builds W + BA for every expert in bf16
    materialized = sum(2 * w.numel for w in layer.weights if w.kind == EXPERT) if ad.targets_routed_experts else 0.0
    return core, down, materialized


def expert_adapter_saved(hidden: int, width: int, rank: int, adapter_bytes: int) -> float:
    """Bytes autograd keeps per routed (token, expert) copy for the routed experts' own adapters
    (``adapter.experts``): the expert's input and the down projection's input in the adapters' dtype
    (the frozen INT4 path keeps neither) and the three ``[r]`` products ``x A^T`` that B's gradient
    needs. The same for every layout: sharing a factor shares parameters, not activations."""
    return float(adapter_bytes * (hidden + width + 3 * rank))


def layer_activations(arch: ArchSpec, layer: Layer, ad: AdapterPlan, st: ActivationSettings) -> LayerActivations:
    if layer.index < ad.first_layer:
        # below the first adapted layer (adapter.last_layers) nothing needs a gradient: forward only, nothing kept
        return LayerActivations(saved=0.0, attention_saved=0.0, attention_block=0.0, mlp_block=0.0)
    h = arch.hidden_size
    norm1 = norm2 = 4.0 * h + 4
    attn, attn_out = _attention_core(arch, layer, ad, st)
    attn_lora = _lora_inputs(arch, layer, ad, (ATTENTION,), st)
    mlp, mlp_down, materialized = _mlp_core(arch, layer, ad, st.act_bytes)
    mlp_lora = _lora_inputs(arch, layer, ad, (MLP, SHARED_EXPERT, EXPERT, ROUTER), st)
    if layer.moe and ad.expert_layout != "none":
        mlp_lora += arch.experts_per_token * expert_adapter_saved(h, arch.moe_intermediate_size, ad.expert_rank,
                                                                  st.adapter_bytes)
    bottleneck = 2.0 * h + 2 * ad.rank if ad.kind == "bottleneck" else 0.0  # MLP output into down, relu into up
    if layer.index == ad.first_layer:
        # nothing before the first trainable weight needs a gradient, so autograd keeps nothing there
        attn_inputs = any(ad.adapted_in(layer.index, w.name) for w in layer.weights if w.kind == ATTENTION and w.suffix != "o_proj")
        o_proj = _adapted(layer, ad, ("o_proj",))
        mlp_inputs = any(ad.adapted_in(layer.index, w.name) for w in layer.weights
                         if w.kind in (MLP, SHARED_EXPERT, EXPERT, ROUTER) and w.suffix != "down_proj")
        norm1 = 0.0  # the layer's input (the embedding, or a frozen layer's output) needs no gradient
        if not attn_inputs:
            attn = attn_out if o_proj else 0.0
            if not o_proj:
                norm2 = 0.0
                if not mlp_inputs:
                    mlp = 0.0
    # gradients of a block are about the size of its own activations, not of the adapters' copies
    mlp_grads = mlp + mlp_down
    if layer.moe and mlp:
        # the expert outputs are weighted and un-permuted in the routing weights' dtype (fp32 for
        # DeepSeek/Kimi routers): backward starts with that gradient, its un-permuted copy and
        # the bf16 expert-output gradient for every routed copy
        weight_bytes = 4 if arch.attention == "mla" else 2
        mlp_grads = max(mlp_grads, arch.experts_per_token * h * (2 * weight_bytes + 2))
    attention_saved = norm1 + attn + attn_lora
    mlp_saved = norm2 + mlp + mlp_down + mlp_lora + bottleneck
    return LayerActivations(saved=attention_saved + mlp_saved, attention_saved=attention_saved,
                            attention_block=attn, mlp_block=mlp_grads + bottleneck, materialized=materialized)


def frozen_outputs(arch: ArchSpec, layer: Layer, st: ActivationSettings) -> float:
    """Bytes per token of a layer's frozen matmuls' outputs (every linear weight's output features, a routed expert's
    once per routed copy): what ``memory.keep_frozen_outputs`` keeps beside the layer's checkpointed input."""
    width = sum(w.shape[0] * (arch.experts_per_token if w.kind == EXPERT else 1) for w in layer.weights if w.linear)
    return float(st.act_bytes * width)


def logits_peak(arch: ArchSpec, st: ActivationSettings, *, grad: bool = True) -> float:
    """Bytes live in the lm_head + loss: 12V per position at the loss backward, 10V in a no-grad pass, over the
    positions that reach the output layer (the completion's, :attr:`ActivationSettings.logit_positions`)."""
    positions = st.logit_positions or st.tokens
    tokens = min(st.loss_chunk, positions) if st.loss_chunk else positions
    per_token = 12 if grad else 10
    return float(per_token * arch.vocab_size * tokens)


def train_activations(arch: ArchSpec, ad: AdapterPlan, st: ActivationSettings) -> TrainActivations:
    """The activation and logits bytes at the peak moment of one micro-batch's forward + backward."""
    t, h = st.tokens, arch.hidden_size
    cache: dict[tuple[int, str], LayerActivations] = {}
    per_layer = []
    for layer in arch.layers:
        # layers sharing one weights tuple have the same shapes and, since targets select by
        # name, the same adapted modules; the first adapted layer differs (its frozen prefix keeps nothing), and
        # the layers below it keep nothing at all
        place = "below" if layer.index < ad.first_layer else "first" if layer.index == ad.first_layer else "above"
        key = (id(layer.weights), place)
        if key not in cache:
            cache[key] = layer_activations(arch, layer, ad, st)
        per_layer.append(cache[key])
    final_norm = (4 * h + 4) * t
    boundary = st.act_bytes * h * t
    host = 0.0
    if st.checkpointing:
        # each layer the backward reaches keeps its input (the layers below the first adapted one: none)
        reached = arch.num_layers - ad.first_layer
        boundaries = 2 * boundary if st.offload else reached * boundary
        host = reached * boundary if st.offload else 0.0
        # memory.keep_frozen_outputs: each reached layer's frozen matmul outputs too, until its backward has run (the
        # layer being recomputed counts them once, among its saved tensors)
        kept_outputs = [frozen_outputs(arch, layer, st) * t for layer in arch.layers[ad.first_layer:]] \
            if st.keep_frozen else [0.0]
        kept = boundaries + sum(kept_outputs)
        layer_moment = kept - max(kept_outputs) + max(la.backward_peak() * t + la.materialized for la in per_layer)
    else:
        kept = sum(la.saved * t + la.materialized for la in per_layer)
        last = per_layer[-1]
        layer_moment = kept + (last.backward_peak() - last.saved) * t
    chunked = bool(st.loss_chunk) and st.loss_chunk < (st.logit_positions or st.tokens)
    # a chunked loss recomputes each chunk's logits in backward and keeps only per-token values
    loss_logits = logits_peak(arch, st) + (8.0 * t if chunked else 0.0)
    no_grad_layer = max(max(la.attention_block, la.mlp_block) * t + la.materialized for la in per_layer)
    logprob_logits = logits_peak(arch, st, grad=False)
    moments = {
        "loss backward": (kept + final_norm, loss_logits),
        "layer backward": (layer_moment, 0.0),
        "log-prob pass": (no_grad_layer, logprob_logits),
    }
    name = max(moments, key=lambda m: sum(moments[m]))
    acts, logits = moments[name]
    return TrainActivations(acts, logits, host, name)
