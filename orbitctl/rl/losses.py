"""The update's arithmetic: advantages, PPO-clip, IS correction, align and reference KLs.

Pure functions of tensors, so each is checked against hand-computed values. Shapes: ``[B, T]``
for per-token quantities (``mask`` is 1 on completion tokens), ``[B]`` for per-sequence ones,
``[B, T, V]`` for log-distributions. Losses are token-level: the caller sums per-token terms
and divides by the number of completion tokens in the whole optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def group_advantages(rewards, group_size: int, std_normalize: bool = True, eps: float = 1e-4):
    """GRPO: each reward minus its group's mean, divided by the group's std when switched on.

    Rows are grouped consecutively: rows ``[g*G, (g+1)*G)`` are one prompt's completions.
    A group whose rewards are all equal gets advantage 0 (nothing to learn from it).
    """
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (grouped.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred.reshape(-1)


def ppo_clip_terms(logp, old_logp, advantages, clip_eps: float):
    """Per-token PPO-clip loss ``-min(r A, clip(r, 1-eps, 1+eps) A)`` and where clipping was active."""
    import torch

    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float(), ratio


@dataclass(frozen=True)
class ISResult:
    weight: "torch.Tensor"      # [B, T] detached multiplier of each token's policy term
    ratio: "torch.Tensor"       # [B, T] pi_train_old / pi_infer on sampled tokens
    clipped: "torch.Tensor"     # [B, T] 1 where TIS truncated or IcePop masked


def is_correction(old_logp, infer_logp, kind: str, cap: float = 2.0, low: float = 0.5, high: float = 5.0) -> ISResult:
    """Rollout/train mismatch correction on sampled tokens.

    ``tis``: weight = min(ratio, cap) (truncated importance sampling).
    ``icepop``: weight = ratio inside [low, high], 0 outside (the token gets no gradient).
    ``none``: weight 1.
    """
    import torch

    ratio = torch.exp((old_logp - infer_logp).detach())
    if kind == "tis":
        return ISResult(torch.clamp(ratio, max=cap), ratio, (ratio > cap).float())
    if kind == "icepop":
        inside = (ratio >= low) & (ratio <= high)
        return ISResult(torch.where(inside, ratio, torch.zeros_like(ratio)), ratio, (~inside).float())
    return ISResult(torch.ones_like(ratio), ratio, torch.zeros_like(ratio))


def kl_full(train_logdist, infer_logdist):
    """KL(train || infer) per token over the whole vocabulary; gradients flow into train only."""
    import torch

    p = torch.exp(train_logdist)
    return (p * (train_logdist - infer_logdist.detach())).sum(-1)


def k3(logp, other_logp):
    """Sampled-token k3 estimate of KL(pi || other): ``exp(d) - d - 1`` with ``d = other - pi``; >= 0."""
    import torch

    d = other_logp - logp
    return torch.exp(d) - d - 1.0


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum().clamp(min=1)


def mismatch_stats(train_logp, infer_logp, mask) -> dict:
    """Train-vs-infer mismatch on sampled tokens, before the update (healthy: k3 < 1e-3, |dp| < 0.005)."""
    import torch

    delta = (train_logp - infer_logp).abs() * mask
    n = mask.sum().clamp(min=1)
    dp = (torch.exp(train_logp) - torch.exp(infer_logp)).abs() * mask
    return {
        "mismatch_logp_abs_mean": float(delta.sum() / n),
        "mismatch_logp_abs_max": float(delta.max()) if mask.any() else 0.0,
        "mismatch_k3_kl": float((k3(train_logp, infer_logp) * mask).sum() / n),
        "mismatch_prob_abs_mean": float(dp.sum() / n),
    }
