"""The policy update on the train path: PPO-clip / GRPO with IS correction, align and reference KL.

One rollout batch gives ``rl.ppo_epochs x rl.minibatches`` optimizer steps; each minibatch is
split into micro-batches of ``memory.micro_batch_size`` whose gradients DeepSpeed accumulates.
Loss aggregation is token-level: every token of the minibatch (on every rank) weighs the same.
A row whose loss is zero whatever the weights (GRPO advantage 0, no align loss or reference KL: :func:`live_rows`)
is not run through the train path; the step's metrics (entropy, mismatch, IS ratios) are then over the rows that ran.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from orbitctl.distances import entropy
from orbitctl.rl.chunked_loss import TokenTerms, chunked_logprobs, chunked_terms, scaled_logdist
from orbitctl.rl.losses import is_correction, k3, kl_full, mismatch_stats, ppo_clip_terms


@dataclass
class StepStats:
    """Sums over one optimizer step's tokens, turned into means by :meth:`means`."""

    tokens: float = 0.0
    sums: dict = field(default_factory=dict)
    maxes: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    """Per-step totals reported as they are (not per token), such as ``offload_bytes``."""
    finite: bool = True
    agreement: object = None
    """The routing agreement of the step's sampled tokens (an MoE with a recorded routing)."""

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value

    def total(self, name: str, value: float) -> None:
        self.totals[name] = self.totals.get(name, 0) + value

    def peak(self, name: str, value: float) -> None:
        self.maxes[name] = max(self.maxes.get(name, -math.inf), value)

    def routing(self, agreement) -> None:
        """Add one micro-batch's routing agreement (:class:`~orbitctl.model.router_replay.Agreement`)."""
        self.agreement = agreement if self.agreement is None else self.agreement + agreement

    def means(self) -> dict:
        n = max(self.tokens, 1.0)
        out = {k: v / n for k, v in self.sums.items()}
        out.update(self.maxes)
        out.update(self.totals)
        if self.agreement is not None and self.agreement.overall is not None:
            layers = [v for v in self.agreement.per_layer() if v is not None]
            out["routing_agreement"] = self.agreement.overall
            out["routing_agreement_min_layer"] = min(layers)
            out["routing_agreement_per_layer"] = self.agreement.per_layer()
        return out


def _rows(batch, rows, advantages, old_logp):
    sel = {
        "prompt_ids": batch.prompt_ids[rows], "prompt_mask": batch.prompt_mask[rows],
        "completion_ids": batch.completion_ids[rows], "completion_mask": batch.completion_mask[rows],
        "attention": _attention(batch)[rows], "infer_logp": batch.infer_logprobs[rows], "adv": advantages[rows],
        "dist": batch.infer_dist[rows] if batch.infer_dist is not None else None,
        "old_logp": old_logp[rows] if old_logp is not None else None,
        "routes": batch.routes[rows] if batch.routes is not None else None,
    }
    return sel


def _attention(batch):
    """Which completion tokens the train path reads: environment tokens too, though no loss counts them."""
    return batch.completion_attention if batch.completion_attention is not None else batch.completion_mask


def _train_logdist(policy, mb, temperature: float, train: bool = True):
    logits = policy.completion_logits(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                      mb["attention"], train=train, routes=mb.get("routes"))
    return scaled_logdist(logits, temperature)


def completion_terms(policy, mb, temperature: float, chunk: int = 0, infer_dist=None) -> TokenTerms:
    """The train path's sampled-token log-probs, KL against ``infer_dist`` (when given) and entropy, [B, T] each:
    from the whole micro-batch's logits (``chunk`` 0), or ``chunk`` positions at a time
    (:mod:`orbitctl.rl.chunked_loss`)."""
    if chunk:
        return chunked_terms(policy, mb, temperature, chunk, infer_dist=infer_dist)
    logdist = _train_logdist(policy, mb, temperature)
    logp = logdist.gather(-1, mb["completion_ids"][..., None]).squeeze(-1)
    return TokenTerms(logp, kl_full(logdist, infer_dist) if infer_dist is not None else None, entropy(logdist.detach()))


def _reference_logp(policy, mb, temperature: float, chunk: int):
    """Sampled-token log-probs of the reference policy (adapters disabled, no grad)."""
    if chunk:
        return chunked_logprobs(policy, mb, temperature, chunk, reference=True)
    ref_logits = policy.reference_logits(mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["attention"],
                                         routes=mb.get("routes"))
    return scaled_logdist(ref_logits, temperature).gather(-1, mb["completion_ids"][..., None]).squeeze(-1)


def old_logprobs(policy, batch, micro: int, temperature: float, chunk: int = 0):
    """Train-path log-probs of the sampled tokens before any update (PPO's pi_old), ``chunk`` positions at a time
    through the output layer when not 0."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, batch.size, micro):
            rows = slice(start, start + micro)
            mb = {"prompt_ids": batch.prompt_ids[rows], "prompt_mask": batch.prompt_mask[rows],
                  "completion_ids": batch.completion_ids[rows], "attention": _attention(batch)[rows],
                  "routes": batch.routes[rows] if batch.routes is not None else None}
            if chunk:
                logp = chunked_logprobs(policy, mb, temperature, chunk)
            else:
                logdist = _train_logdist(policy, mb, temperature, train=False)
                logp = logdist.gather(-1, mb["completion_ids"][..., None].to(logdist.device)).squeeze(-1)
            out.append(logp.cpu())  # the batch stays on the host
    return torch.cat(out, 0) * batch.completion_mask


def micro_loss(policy, mb, profile, token_total: float, stats: StepStats):
    """Loss of one micro-batch, already divided by the minibatch's global token count."""
    import torch

    from orbitctl.model.offload import offloaded_boundaries

    rl, temperature, chunk = profile.rl, profile.rollout.temperature, profile.memory.loss_chunk_size
    device = policy.device  # the rollout batch lives on the host; this micro-batch goes where the model is
    # (a chunked loss moves the infer distribution to the device one chunk at a time)
    mb = {k: v.to(device) if isinstance(v, torch.Tensor) and not (chunk and k == "dist") else v for k, v in mb.items()}
    mask = mb["completion_mask"].float()
    align_kl = rl.align_loss.active
    with offloaded_boundaries(policy.model, profile.memory.offload_activations == "cpu") as moved:
        terms = completion_terms(policy, mb, temperature, chunk, infer_dist=mb["dist"] if align_kl else None)
    stats.total("offload_bytes", moved.bytes)
    if mb.get("routes") is not None and policy.routing is not None:
        stats.routing(policy.routing_agreement(mb["routes"], mb["prompt_ids"].shape[1], mb["completion_mask"]))
    logp = terms.logp * mask
    old = mb["old_logp"] if mb["old_logp"] is not None else logp.detach()
    pg, clipped, ratio = ppo_clip_terms(logp, old, mb["adv"], rl.clip_eps)
    isc = is_correction(old, mb["infer_logp"], rl.is_correction.kind, rl.is_correction.cap,
                        rl.is_correction.low, rl.is_correction.high)
    token_loss = pg * isc.weight
    stats.add("policy_loss", float((pg.detach() * isc.weight * mask).sum()))
    if align_kl:
        align = terms.kl_full if terms.kl_full is not None else k3(logp, mb["infer_logp"])
        token_loss = token_loss + rl.align_loss.weight * align
        stats.add("align_loss", float((align.detach() * mask).sum()))
    if rl.kl_ref_coef > 0:
        ref_logp = _reference_logp(policy, mb, temperature, chunk)
        ref_kl = k3(logp, ref_logp)
        token_loss = token_loss + rl.kl_ref_coef * ref_kl
        stats.add("ref_kl", float((ref_kl.detach() * mask).sum()))
    n = float(mask.sum())
    stats.tokens += n
    stats.add("entropy", float((terms.entropy * mask).sum()))
    stats.add("is_ratio_mean", float((isc.ratio * mask).sum()))
    stats.add("is_clipped_fraction", float((isc.clipped * mask).sum()))
    stats.add("ppo_clipped_fraction", float((clipped * mask).sum()))
    if n:  # the masked extremes at a static shape (a boolean-mask index would size its output by the data)
        counted = mask.bool()
        stats.peak("is_ratio_max", float(torch.where(counted, isc.ratio, float("-inf")).max()))
        stats.peak("neg_is_ratio_min", float(-torch.where(counted, isc.ratio, float("inf")).min()))
    for name, value in mismatch_stats(logp.detach(), mb["infer_logp"], mask).items():
        if name.endswith("_max"):
            stats.peak(name, value)
        else:
            stats.add(name, value * n)
    return (token_loss * mask).sum() / token_total


def live_rows(rl, advantages):
    """Which rows' loss has a gradient: those with an advantage, when no other term reads a row (no align loss, no
    reference KL); None when every row's does. A GRPO group whose episodes all got the same reward has advantage 0 on
    every row, and with PPO-clip alone its loss is 0 whatever the weights."""
    if rl.kl_ref_coef > 0 or rl.align_loss.active:
        return None
    return advantages != 0


def micro_rows(rows, micro: int, live=None) -> list:
    """The rows of each micro-batch: ``rows`` in runs of ``micro``, each keeping only its ``live`` rows, or its first
    row alone when none is live (a gradient of zero), so every micro-batch, on every rank, still runs one forward and
    backward: DeepSpeed's accumulation boundary and ZeRO's gradient reduction count them. The loss stays divided by
    the whole minibatch's tokens, so the gradient is the one every row would give."""
    parts = [rows[s:s + micro] for s in range(0, len(rows), micro)]
    if live is None:
        return parts
    return [part[live[part]] if bool(live[part].any()) else part[:1] for part in parts]


def run_update(engine, policy, batch, advantages, profile, on_step, max_steps: int | None = None) -> bool:
    """The optimizer steps for one rollout batch (at most ``max_steps``);
    ``on_step(stats, seconds, applied, grad_norm)`` after each. Returns whether every row ran (:func:`live_rows`)."""
    import torch

    from orbitctl.dist.collectives import reduce_scalars

    rl, micro = profile.rl, profile.memory.micro_batch_size
    old = old_logprobs(policy, batch, micro, profile.rollout.temperature, profile.memory.loss_chunk_size) \
        if rl.ppo_epochs * rl.minibatches > 1 else None
    generator = torch.Generator().manual_seed(int(engine.global_steps))
    per_minibatch = batch.size // rl.minibatches
    budget = rl.ppo_epochs * rl.minibatches if max_steps is None else max_steps
    live = live_rows(rl, advantages)
    every = live is None or bool(live.all())
    for _epoch in range(rl.ppo_epochs):
        order = torch.randperm(batch.size, generator=generator) if rl.minibatches > 1 else torch.arange(batch.size)
        for m in range(rl.minibatches):
            if budget <= 0:
                return every
            budget -= 1
            start = time.perf_counter()
            rows_all = order[m * per_minibatch:(m + 1) * per_minibatch]
            token_total = reduce_scalars([float(batch.completion_mask[rows_all].sum())])[0] / _world()
            stats = StepStats()
            for rows in micro_rows(rows_all, micro, live):
                mb = _rows(batch, rows, advantages, old)
                loss = micro_loss(policy, mb, profile, max(token_total, 1.0), stats)
                stats.finite = stats.finite and bool(torch.isfinite(loss))
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
            on_step(stats, time.perf_counter() - start, engine.was_step_applied(), engine.get_global_grad_norm())
    return every


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1
