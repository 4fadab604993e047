"""Sampling draws keyed by the sequence, not by the rank: the same run on 1 or N ranks samples alike.

A shared generator hands out draws in the order rows are sampled, so how the rows are split over
ranks and rollout batches decides which row gets which number. Here row ``key`` at decode step
``t`` always gets the uniform ``u(seed, key, t)`` (splitmix64 applied three times, counter-based
like Philox: no state to save, to split or to restore), and the token is the inverse CDF of the
row's distribution at ``u``. The trainer keys a row by its prompt's position in the run's prompt
stream and its index in the group, so a run on 2 ranks and the same run on 1 rank draw the same
tokens wherever their probabilities agree (they differ by kernel rounding only, and a rounding
difference changes a token only when ``u`` falls within it of a CDF boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of Vigna's splitmix64 finaliser: a bijection of 64-bit integers with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def unsplitmix64(x: int) -> int:
    """The inverse of :func:`splitmix64`: ``unsplitmix64(splitmix64(x)) == x``."""
    def unxorshift(y: int, shift: int) -> int:
        value = y
        for _ in range(64 // shift + 1):
            value = y ^ (value >> shift)
        return value

    x = unxorshift(x & _MASK, 31)
    x = (x * pow(0x94D049BB133111EB, -1, 1 << 64)) & _MASK
    x = unxorshift(x, 27)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _MASK
    x = unxorshift(x, 30)
    return (x - 0x9E3779B97F4A7C15) & _MASK


def offset_seed(seed: int, offset: int, count: int) -> int | None:
    """A seed under which keys ``0 .. count-1`` draw what keys ``offset .. offset+count-1`` draw under ``seed``;
    None when there is none of this form. It exists when ``offset`` is a multiple of a power of two of at
    least ``count`` (then ``offset ^ k == offset + k`` for every ``k < count``, and the first mix of the key
    absorbs the offset). A server that draws one request's ``n`` completions from keys ``0 .. n-1`` then
    samples exactly as the trainer's own rollout does for that prompt."""
    block = 1 << max(0, (count - 1).bit_length())
    if offset < 0 or offset % block:
        return None
    return unsplitmix64(splitmix64(seed & _MASK) ^ (offset & _MASK))


def keyed_uniform(seed: int, key: int, step: int) -> float:
    """A uniform in (0, 1) (53 bits, never 0 or 1) that depends only on ``(seed, key, step)``."""
    h = splitmix64(splitmix64(splitmix64(seed & _MASK) ^ (key & _MASK)) ^ (step & _MASK))
    return ((h >> 11) + 0.5) / float(1 << 53)


@dataclass(frozen=True)
class KeyedDraws:
    """The draws of one sampled batch: one key per row."""

    seed: int
    keys: tuple[int, ...]

    def uniforms(self, step: "int | Sequence[int]") -> "torch.Tensor":
        """Each row's uniform at ``step``, or at its own step (one per key: rows of a continuous batch are at
        different tokens)."""
        import torch

        steps = [step] * len(self.keys) if isinstance(step, int) else list(step)
        return torch.tensor([keyed_uniform(self.seed, k, t) for k, t in zip(self.keys, steps, strict=True)],
                            dtype=torch.float64)

    def sample(self, probs: "torch.Tensor", step: "int | Sequence[int]") -> "torch.Tensor":
        """One token per row of ``probs`` [B, V] (rows need not sum to 1): the inverse CDF at this step's uniforms
        (``step`` one per row: each row's own)."""
        import torch

        if probs.shape[0] != len(self.keys):
            raise ValueError(f"{probs.shape[0]} rows to sample, {len(self.keys)} keys")
        # where the probabilities are: the [B, V] rows never leave the device, only the B uniforms come to it (a
        # host-to-device copy of B numbers, no sync); float64 keeps the CDF's sums the same on every device kind
        cdf = probs.detach().double().cumsum(-1)
        target = self.uniforms(step).to(cdf.device, non_blocking=True) * cdf[:, -1]
        # the first token whose cumulative mass reaches the target; a zero-probability token never does
        # (its CDF equals its predecessor's, which the target already exceeds)
        token = torch.searchsorted(cdf, target[:, None]).squeeze(-1)
        return token.clamp(max=probs.shape[-1] - 1)
