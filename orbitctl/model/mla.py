"""MLA decode on the cached latent (DeepSeek-V3, Kimi-K2): attention without re-expanding the context every step.

    use_absorbed_mla(model)     # once, after loading: every MLA attention layer decodes on its latent

transformers' DeepSeek-V3 attention caches the compressed latent (``kv_nope``, ``kv_lora_rank`` wide, and
the shared RoPE key) and, at every step, runs ``kv_b_proj`` over the *whole* cached context to rebuild
per-head K and V (``expand_kv``). At decode that is ``2 x context x kv_lora_rank x heads x (d_nope + d_v)``
FLOPs per sequence and layer, and per-head K and V written and read again: on Kimi-K2 at 36 sequences
and a 2,560-token mean context, 1.5 TFLOP and 7.5 GB per layer per step, far more than the step's
weights. The product is associative, so the per-head up-projection can move to the query and the
output instead (the "absorbed" form inference engines decode with):

    q_lat   = q_nope W_UK                          [heads, kv_lora]   W_UK, W_UV: kv_b_proj's K and V rows per head
    scores  = (q_lat c^T + q_rope k_rope^T) s      over the cached latent c and RoPE key, one "head" shared (MQA)
    out     = (softmax(scores) c) W_UV^T           [heads, d_v], then o_proj

Per step that reads the latent cache once and costs ``2 x context x heads x (2 kv_lora + rope)`` FLOPs.
``kv_b_proj``'s effective weight (its base, quantized or not, plus a LoRA adapter) is taken once per
decode (per cache and layer) by running the layer on the identity, so it is what the layer computes.

Only one-token decode steps take this path; a prefill and the train path's full sequences expand as
transformers does (there the expansion is the per-token cost already counted, and the attention kernel
keeps its memory-lean form). The two forms are the same function in exact arithmetic; they round
differently (``verify-alignment`` on the tiny MoE measures it against its floor).
"""

from __future__ import annotations

import torch
from torch import nn


def is_mla_attention(module: nn.Module) -> bool:
    """A transformers DeepSeek-V3-type attention layer: a latent KV cache expanded by ``kv_b_proj``."""
    return all(hasattr(module, name) for name in ("kv_b_proj", "kv_a_proj_with_mqa", "expand_kv", "kv_lora_rank"))


def use_absorbed_mla(model: nn.Module) -> int:
    """Make every MLA attention layer of ``model`` decode on its cached latent; returns how many."""
    count = 0
    for module in model.modules():
        if is_mla_attention(module) and not isinstance(module, _Absorbed):
            module.__class__ = _absorbed_class(type(module))
            count += 1
    return count


class _Absorbed:
    """Marker of the classes :func:`_absorbed_class` makes."""


_CLASSES: dict[type, type] = {}


def _absorbed_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Absorbed{base.__name__}", (_Absorbed, base), {"forward": _forward})
    return _CLASSES[base]


def _forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    batch, length = hidden_states.shape[:-1]
    if length != 1 or cache is None:
        return super(type(self), self).forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    return absorbed_decode(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)


def _rope(module, q_rot, k_rot, position_embeddings):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cos, sin = position_embeddings
    if module.config.rope_interleave:
        return ds.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    return ds.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)


def up_projection(module, cache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [heads, d_nope, kv_lora], W_UV [heads, d_v, kv_lora])``: ``kv_b_proj`` as the layer computes it
    (quantized base, adapter and all), taken on the identity once per cache and layer."""
    store = cache.__dict__.setdefault("_orbitctl_mla_up", {})
    key = (module.layer_idx, dtype)
    if key not in store:
        eye = torch.eye(module.kv_lora_rank, dtype=dtype, device=module.kv_a_proj_with_mqa.weight.device)
        weight = module.kv_b_proj(eye).t()  # [heads x (d_nope + d_v), kv_lora]
        weight = weight.reshape(-1, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)
        store[key] = (weight[:, :module.qk_nope_head_dim], weight[:, module.qk_nope_head_dim:])
    return store[key]


def absorbed_decode(module, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
    """One decode step of an MLA layer on the cached latent (the module docstring); returns what its forward does."""
    batch = hidden_states.shape[0]
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch, 1, -1, module.qk_head_dim).transpose(1, 2)  # [B, H, 1, d_qk]
    q_pass, q_rot = torch.split(q, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    compressed = module.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope).view(batch, 1, 1, module.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, 1, module.qk_rope_head_dim)
    q_rot, k_rot = _rope(module, q_rot, k_rot, position_embeddings)
    latent, rope_keys = cache.update(kv_nope, k_rot, module.layer_idx, kwargs=kwargs)  # [B, 1, ctx, .]
    w_uk, w_uv = up_projection(module, cache, latent.dtype)
    # per head, batched over the heads: a matmul against w[None] would broadcast (copy) the weight once per sequence
    q_lat = torch.bmm(q_pass.squeeze(2).transpose(0, 1), w_uk).transpose(0, 1).unsqueeze(2)  # [B, H, 1, kv_lora]
    scores = (torch.matmul(q_lat, latent.transpose(2, 3)) + torch.matmul(q_rot, rope_keys.transpose(2, 3))) \
        * module.scaling
    if attention_mask is not None:
        mask = attention_mask[..., :scores.shape[-1]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
    out_lat = torch.matmul(probs, latent)  # [B, H, 1, kv_lora]
    out = torch.bmm(out_lat.squeeze(2).transpose(0, 1), w_uv.transpose(1, 2))  # [H, B, d_v]
    out = out.transpose(0, 1).reshape(batch, 1, -1)
    return module.o_proj(out), probs
