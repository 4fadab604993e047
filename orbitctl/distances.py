"""Distances between two next-token log-distributions, and their entropy: pure torch, no model code.

    from orbitctl.distances import entropy, js_divergence, logsoftmax_l1, topk_agreement
    js_divergence(torch.log_softmax(a, -1), torch.log_softmax(b, -1))   # one value per position

Inputs are log-probabilities ``[..., V]``; every function reduces over the vocabulary only and
returns one value per position, in float32 (float64 inputs stay float64). The quantization report
compares original vs quantized logits with them, the trainer logs the policy's entropy, and
verify-alignment's per-token metrics (:mod:`orbitctl.align.metrics`) use the same entropy.
"""

from __future__ import annotations

import math

import torch


def _as_float(logp: torch.Tensor) -> torch.Tensor:
    return logp.float() if logp.dtype != torch.float64 else logp


def js_divergence(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in nats per position, in [0, ln 2]."""
    a, b = _as_float(logp_a), _as_float(logp_b)
    # log of the mixture m = (p + q) / 2, computed in log space so tiny probabilities stay exact
    log_m = torch.logaddexp(a, b) - math.log(2.0)
    kl_am = (a.exp() * (a - log_m)).sum(-1)
    kl_bm = (b.exp() * (b - log_m)).sum(-1)
    return (0.5 * (kl_am + kl_bm)).clamp_min(0.0)


def kl_divergence(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) in nats per position."""
    a, b = _as_float(logp_a), _as_float(logp_b)
    return (a.exp() * (a - b)).sum(-1).clamp_min(0.0)


def logsoftmax_l1(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of the log-softmax vectors per position (nats per vocabulary entry)."""
    a, b = _as_float(logp_a), _as_float(logp_b)
    return (a - b).abs().mean(-1)


def topk_agreement(logp_a: torch.Tensor, logp_b: torch.Tensor, k: int = 1) -> torch.Tensor:
    """1.0 where both distributions have the same set of top-k tokens, else 0.0 (k=1: same argmax)."""
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    k = min(k, logp_a.shape[-1])
    top_a = logp_a.topk(k, dim=-1).indices.sort(dim=-1).values
    top_b = logp_b.topk(k, dim=-1).indices.sort(dim=-1).values
    return (top_a == top_b).all(dim=-1).float()


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats per position; a -inf entry (a masked token) contributes 0, not NaN."""
    p = _as_float(logp)
    return 0.0 - torch.where(torch.isneginf(p), 0.0, p.exp() * p).sum(-1)  # 0.0 - x: never prints -0
