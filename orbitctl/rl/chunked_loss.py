"""The output layer and the terms over the vocabulary a chunk of positions at a time (``memory.loss_chunk_size``).

Unchunked, the train path computes the logits of a whole micro-batch, ``[B, T, V]``, and the fp32
log-softmax autograd keeps for the backward: at a 150k-token vocabulary that is gigabytes per
micro-batch. Chunked, the model runs up to its final norm (:meth:`Policy.completion_hidden`, the
completion positions only, as ``logits_to_keep`` selects them) and the rest runs on ``chunk``
positions at a time, each chunk under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant):

    hidden [B*T, H] --chunk--> output layer --> logits / temperature --> fp32 log-softmax
        --> sampled-token log-prob, KL(train || infer) over the vocabulary, entropy

Autograd keeps only each chunk's inputs (a view of the hidden states, a view of the host copy of
the infer distribution, which moves to the device inside the chunk); the backward recomputes the
chunk's logits and frees them before the next chunk's, so no ``[., V]`` tensor larger than one
chunk is ever alive. What leaves a chunk is per token: the sampled-token log-prob (the policy
term, the IS weights, the k3 align estimate and the reference KL are all functions of it and of
other per-token values), the full KL when the infer distribution is at hand, and the entropy
(detached, a metric). The no-grad passes (PPO's pi_old, the reference policy with adapters
disabled) run the same chunks without the checkpoint.

The output layer is called as the module the forward calls (same weights, tied or not, same
adapters and hooks). Under ZeRO-3 each call gathers its partitioned weight with the other ranks,
so every rank runs the same number of chunks (the largest; a rank with fewer positions runs
empty ones) in the forward and, by the recompute, in the backward.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orbitctl.distances import entropy
from orbitctl.model.adapters import adapters_disabled
from orbitctl.rl.losses import kl_full

if TYPE_CHECKING:
    import torch


@dataclass
class TokenTerms:
    """The train path's per-token values over the vocabulary, [B, T] each (not yet masked)."""

    logp: "torch.Tensor"
    """Log-prob of each sampled token under the temperature-scaled train distribution (gradients flow)."""
    kl_full: "torch.Tensor | None"
    """KL(train || infer) over the vocabulary, when the infer log-distribution was given (gradients flow)."""
    entropy: "torch.Tensor | None"
    """Entropy of the train distribution in nats (detached); None from a pass that did not ask for it."""


def scaled_logdist(logits, temperature: float):
    """The fp32 log-softmax of ``logits / temperature`` (temperature 0, greedy decoding, scales by 1)."""
    import torch

    return torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


def chunked_terms(policy, mb, temperature: float, chunk: int, *, infer_dist=None) -> TokenTerms:
    """:class:`TokenTerms` of the train path (train mode, adapters on), ``chunk`` positions at a time.

    ``mb`` holds ``prompt_ids``, ``prompt_mask``, ``completion_ids`` and ``attention`` (the completion
    tokens the model reads); ``infer_dist`` is the infer path's [B, T, V] log-distribution, wherever it lives.
    """
    hidden = policy.completion_hidden(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["attention"],
                                      routes=mb.get("routes"))
    return over_chunks(policy.output_layer, hidden, mb["completion_ids"].to(hidden.device), temperature, chunk,
                       infer_dist=infer_dist)


def chunked_logprobs(policy, mb, temperature: float, chunk: int, *, reference: bool = False):
    """Sampled-token log-probs, [B, T], without gradients: PPO's pi_old (eval mode, adapters on) or, with
    ``reference``, the reference policy (adapters disabled for the forward and the output layer alike)."""
    import torch

    with torch.no_grad(), (adapters_disabled(policy.model) if reference else nullcontext()):
        hidden = policy.completion_hidden(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["attention"],
                                          train=False, routes=mb.get("routes"))
        terms = over_chunks(policy.output_layer, hidden, mb["completion_ids"].to(hidden.device), temperature, chunk,
                            with_entropy=False)
    return terms.logp


def over_chunks(output_layer, hidden, targets, temperature: float, chunk: int, *, infer_dist=None,
                with_entropy: bool = True) -> TokenTerms:
    """:class:`TokenTerms` from final hidden states [B, T, H] and sampled tokens [B, T], ``chunk`` positions at a
    time; each chunk is recomputed in backward when ``hidden`` takes gradients."""
    import torch
    from torch.utils.checkpoint import checkpoint

    batch, length = targets.shape
    positions = batch * length
    flat_hidden, flat_targets = hidden.reshape(positions, hidden.shape[-1]), targets.reshape(positions)
    flat_infer = infer_dist.reshape(positions, infer_dist.shape[-1]) if infer_dist is not None else None
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for index in range(_agreed_chunk_count(max(1, -(-positions // chunk)), hidden.device)):
        rows = slice(min(index * chunk, positions), min((index + 1) * chunk, positions))
        args = (output_layer, flat_hidden[rows], flat_targets[rows], temperature,
                flat_infer[rows] if flat_infer is not None else None, with_entropy)
        # no metadata check of the recomputed tensors: under ZeRO-3 the output layer's weight is saved as the
        # partitioned parameter, empty again by the time the check would look (DeepSpeed gathers it for the backward)
        parts.append(checkpoint(_chunk_terms, *args, use_reentrant=False, determinism_check="none") if recompute
                     else _chunk_terms(*args))

    def joined(values):
        return torch.cat(values).view(batch, length) if values[0] is not None else None

    logp, kl, ent = (joined([p[i] for p in parts]) for i in range(3))
    return TokenTerms(logp, kl, ent)


def _chunk_terms(output_layer, hidden, targets, temperature: float, infer, with_entropy: bool):
    """One chunk: (sampled-token log-probs, KL against ``infer`` or None, entropy or None), [n] each."""
    logdist = scaled_logdist(output_layer(hidden), temperature)
    logp = logdist.gather(-1, targets[:, None]).squeeze(-1)
    kl = kl_full(logdist, infer.to(logdist.device, non_blocking=True)) if infer is not None else None
    return logp, kl, entropy(logdist.detach()) if with_entropy else None


def _agreed_chunk_count(count: int, device) -> int:
    """The largest chunk count of any rank: ZeRO-3 gathers the output layer's weight on every call, with all ranks."""
    from orbitctl.dist.collectives import reduce_scalars

    return reduce_scalars([int(count)], "max")[0]
