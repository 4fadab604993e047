"""Rollout: G completions per prompt on the infer path, then rewards and held-out evaluation."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orbitctl.data.tasks import PromptItem

if TYPE_CHECKING:
    import torch


@dataclass
class RolloutBatch:
    """One step's experience; rows ``[g*G, (g+1)*G)`` are one prompt's group."""

    items: list[PromptItem]
    prompt_ids: "torch.Tensor"
    prompt_mask: "torch.Tensor"
    completion_ids: "torch.Tensor"
    completion_mask: "torch.Tensor"
    infer_logprobs: "torch.Tensor"
    infer_dist: "torch.Tensor | None"
    completions: list[str]
    rewards: "torch.Tensor"
    rollout_s: float
    reward_s: float
    completion_attention: "torch.Tensor | None" = None
    """[B, T] 1 on every real completion token, the environment's included (multi-turn rollouts); None: the
    same as ``completion_mask``. The train path attends to these; the losses count ``completion_mask`` only."""
    routes: "torch.Tensor | None" = None
    """[B, T, L_moe, k] the experts each completion token was routed to on the infer path, per MoE layer (-1: not
    recorded); None on a dense model or when the engine returns none. Replayed by ``rl.router_replay``."""
    tool_calls: "tuple[int, int] | None" = None
    """``(valid, attempted)`` tool calls in the episodes of an environment with tools; None otherwise."""

    @property
    def size(self) -> int:
        return self.completion_ids.shape[0]


def _pad_right(tensors, value):
    import torch

    width = max(t.shape[1] for t in tensors)
    if len(tensors) == 1 and tensors[0].shape[1] == width:
        return tensors[0]  # one chunk's tensor as it is: a cat would copy it (the kept infer distribution twice)
    out = []
    for t in tensors:
        if t.shape[1] < width:
            pad_shape = (t.shape[0], width - t.shape[1]) + tuple(t.shape[2:])
            t = torch.cat([t, torch.full(pad_shape, value, dtype=t.dtype)], dim=1)
        out.append(t)
    return torch.cat(out, dim=0)


def _pad_left(tensors, value):
    import torch

    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.cat([torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype), t], dim=1)
                      for t in tensors], dim=0)


def sample_groups(policy, items: list[PromptItem], *, group_size: int, batch_size: int, max_new_tokens: int,
                  temperature: float, top_p: float, generator, keep_dist: bool, keys=None):
    """Sample ``group_size`` completions for every item in chunks of ``batch_size`` sequences.

    ``keys`` = ``(seed, positions)``, one position per item: completion ``g`` of the item at position
    ``p`` draws its tokens from key ``p * group_size + g`` (:mod:`orbitctl.model.draws`) instead of
    ``generator``, so the draws do not depend on how items are split over ranks and chunks.
    With the policy's continuous batching (``rollout.continuous_batching``) all the rows go to one
    :meth:`~orbitctl.model.policy.Policy.sample_stream` with ``batch_size`` slots instead.
    """
    from orbitctl.model.draws import KeyedDraws

    expanded = [it for it in items for _ in range(group_size)]
    row_keys = [p * group_size + g for p in keys[1] for g in range(group_size)] if keys is not None else None
    if policy.continuous_batching:
        import torch

        # each prompt encoded once and repeated for its group (the padding is the same: the same prompts)
        ids, mask = (t.repeat_interleave(group_size, dim=0) for t in policy.encode_prompts([it.prompt for it in items])) \
            if expanded else (torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1), dtype=torch.long))
        samples = policy.sample_stream(ids, mask, slots=batch_size, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, generator=generator, keep_dist=keep_dist,
                                       draws=KeyedDraws(keys[0], tuple(row_keys)) if row_keys else None)
        return expanded, [samples] if expanded else []
    parts = []
    for start, chunk in lockstep_chunks(policy, expanded, batch_size):
        ids, mask = policy.encode_prompts([it.prompt for it in chunk]) if chunk else policy.filler()
        draws = KeyedDraws(keys[0], tuple(row_keys[start:start + len(chunk)])) if chunk and row_keys else None
        samples = policy.sample(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, generator=generator, keep_dist=keep_dist, draws=draws)
        if chunk:
            parts.append(samples)
    return expanded, parts


def lockstep_chunks(policy, items: list, batch_size: int):
    """``(start, chunk)`` for ``items`` in chunks of ``batch_size``, then empty chunks until every rank has had
    as many: under expert parallelism each rank must call the model as often as the others (an empty chunk
    runs a filler)."""
    chunks = [(start, items[start:start + batch_size]) for start in range(0, len(items), batch_size)]
    return chunks + [(len(items), []) for _ in range(policy.lockstep.rounds(len(chunks)) - len(chunks))]


def collect(policy, items, reward_fn, *, group_size: int, batch_size: int, max_new_tokens: int,
            temperature: float, top_p: float, generator, keep_dist: bool, keys=None) -> RolloutBatch:
    """One step's experience for ``items``; ``keys`` as in :func:`sample_groups`."""
    start = time.perf_counter()
    expanded, parts = sample_groups(policy, items, group_size=group_size, batch_size=batch_size,
                                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    generator=generator, keep_dist=keep_dist, keys=keys)
    pad = policy.pad_id
    completion_ids = _pad_right([p.completion_ids for p in parts], pad)
    completion_mask = _pad_right([p.completion_mask for p in parts], 0)
    logprobs = _pad_right([p.logprobs for p in parts], 0.0)
    dist = _pad_right([p.dist for p in parts], 0.0) if keep_dist else None
    prompt_ids = _pad_left([p.prompt_ids for p in parts], pad)
    prompt_mask = _pad_left([p.prompt_mask for p in parts], 0)
    routes = _pad_right([p.routes for p in parts], -1) if parts and all(p.routes is not None for p in parts) else None
    return rewarded(policy, expanded, (prompt_ids, prompt_mask), (completion_ids, completion_mask), logprobs, dist,
                    reward_fn, start, routes=routes)


def rewarded(policy, expanded, prompts, completions, logprobs, dist, reward_fn, start: float,
             routes=None) -> RolloutBatch:
    """The batch of sampled ``(ids, mask)`` pairs with its texts and rewards; the rollout timed from ``start``."""
    import torch

    texts = policy.decode(*completions)
    rollout_s = time.perf_counter() - start
    start = time.perf_counter()
    rewards = torch.tensor(reward_fn(texts, expanded), dtype=torch.float32)
    return RolloutBatch(expanded, *prompts, *completions, logprobs, dist, texts, rewards, rollout_s,
                        time.perf_counter() - start, routes=routes)


def evaluate(policy, items: list[PromptItem], reward_fn, *, batch_size: int, max_new_tokens: int, generator) -> dict:
    """Held-out greedy accuracy (share of prompts with full reward) and mean reward, summed for all-reduce."""
    import torch

    correct, total, reward_sum = 0.0, 0, 0.0
    for _, chunk in lockstep_chunks(policy, items, batch_size):
        ids, mask = policy.encode_prompts([it.prompt for it in chunk]) if chunk else policy.filler()
        out = policy.sample(ids, mask, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
                            generator=generator)
        if not chunk:
            continue
        rewards = torch.tensor(reward_fn(policy.decode(out.completion_ids, out.completion_mask), chunk))
        correct += float((rewards >= 1.0 - 1e-9).sum())
        reward_sum += float(rewards.sum())
        total += len(chunk)
    return {"correct": correct, "total": total, "reward_sum": reward_sum}
