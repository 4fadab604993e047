"""Attention for a decode step on the CPU: one new query position per row against the KV cache.

    model.config._attn_implementation = use_decode_attention()   # at load, where the model runs SDPA

transformers' ``sdpa`` attention calls PyTorch's fused SDPA kernel for every forward. On the CPU that
kernel is built for long queries: for one query position a call costs about as much as for a block of 32
(it packs K and V for its block GEMMs on every call). At the representative setting's decode (32 rows, 12
heads, 45-109 cached positions, bf16) a layer's attention took 2.0 ms a step, 19% of the rollout; the same
arithmetic written out below takes 1.2 ms, most of it reading K and V into float32.

:func:`decode_attention` is the computation the fused kernel does, in the order it does it: scores in
float32 from the compute-dtype Q and K (their products are exact in float32), scaled, masked, the row's
maximum subtracted, exponentiated and summed in float32, the exponentials rounded to the compute dtype
for the product with V (as the kernel rounds them for its second GEMM), accumulated in float32, divided
by the sum, rounded to the compute dtype. It differs from the kernel in the order of the float32 sums
and in the exponential (the kernel's is a vectorised approximation), so the decode and the train path's
full-sequence forward agree to the compute dtype's rounding, not bit for bit: the kernel floor that
verify-alignment measures on the machine that runs it (:mod:`orbitctl.align.floor`).

In bf16 on a CPU with AVX512-BF16 the same sums run in :func:`orbitctl.kernels.bf16_cpu.decode_attention`, which
reads K and V where the cache holds them instead of converting the history to float32 every step.

Everything else goes to transformers' SDPA attention unchanged: any forward with more than one query
position (the prefill and the whole train path), a GPU (whose SDPA kernels have a decode path), autograd,
dropout, the planner's fake tensors and compiled graphs.
"""

from __future__ import annotations

import torch

from orbitctl.kernels.eager import real_eager

DECODE_SDPA = "orbitctl_sdpa"
"""The ``attn_implementation`` name: SDPA, with :func:`decode_attention` for the CPU's one-position queries."""


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """Attention of one query position per row: query ``[B, H, 1, D]``, key ``[B, Hkv, T, D]``, value
    ``[B, Hkv, T, Dv]`` (``H`` a multiple of ``Hkv``: grouped queries read their KV head without a copy), ``mask``
    None, boolean (True: attend) or additive, broadcastable to ``[B, H, 1, T]``; returns ``[B, H, 1, Dv]`` in the
    query's dtype. A row whose every position is masked gets zeros.

    Numerics: Q, K, V in the compute dtype (bf16, fp16 or float32); scores, softmax and the product with V
    accumulated in float32, the exponentials rounded to the compute dtype before that product, one rounding to the
    compute dtype at the end. Each (row, head) is independent of the others. The reference: SDPA's fused CPU kernel,
    the same function with its float32 sums in another order (the module's docstring)."""
    if query.dtype == torch.bfloat16:  # bf16 on a CPU with AVX512-BF16: the same sums, reading the cache in place
        from orbitctl.kernels import bf16_cpu

        out = bf16_cpu.decode_attention(query, key, value, mask, scaling)
        if out is not None:
            return out
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups, dim).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scaling)  # [B, Hkv, G, T]
    if mask is not None:
        if mask.shape[1] == heads and heads != 1:
            mask = mask.reshape(mask.shape[0], kv_heads, groups, length)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask.float())
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores.sub_(top))
    total = weights.sum(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    if query.dtype != torch.float32:  # the kernel's second GEMM reads the exponentials in the compute dtype
        weights = weights.to(query.dtype).float()
    out = torch.matmul(weights, value.float()).div_(total)  # [B, Hkv, G, Dv]
    return out.to(query.dtype).reshape(batch, heads, 1, value.shape[-1])


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """transformers' attention-function interface: :func:`decode_attention` for a one-position CPU query, else
    transformers' own SDPA attention with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (query.shape[2] == 1 and not dropout and kwargs.get("position_bias") is None
             and kwargs.get("softcap") is None and query.device.type == "cpu"
             and not (torch.is_grad_enabled() and query.requires_grad) and real_eager(query))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = decode_attention(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def use_decode_attention() -> str:
    """Register :data:`DECODE_SDPA` with transformers (its attention function, and SDPA's mask builder) and return
    the name, for ``config._attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_SDPA, attention)
    AttentionMaskInterface.register(DECODE_SDPA, sdpa_mask)
    return DECODE_SDPA
