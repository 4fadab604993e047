"""Multi-turn rollouts: the policy plays episodes of an environment (``data.train: env:NAME``).

Per episode the prompt is the first observation. Each turn the policy samples an action (until EOS,
a newline or ``rollout.max_new_tokens`` tokens), the environment answers, and its reply's tokens are
appended to the context, until the episode is done or ``rollout.max_turns`` actions were played.
The result is a :class:`~orbitctl.rl.rollout.RolloutBatch` like the single-turn one: the completion
holds the actions and the environment's replies in order; ``completion_mask`` is 1 on the policy's
own tokens only, so the losses, the IS correction and the mismatch metrics never see environment
tokens, while ``completion_attention`` (1 on both) lets the train path's forward read them as context.
The reward of every row is its episode's return.

Under ``data.chat_template`` an episode is a conversation in the model's own chat template
(:mod:`orbitctl.rl.chat_turns`): an action is an assistant turn that ends at the EOS, the environment's answer a
``tool`` turn after a tool call or a user turn, each turn's tokens appended once and never rendered again, so the
completion holds exactly the tokens the sampler read and drew. In an environment with tools each action is read as
a tool call (:mod:`orbitctl.rl.envs.tools`); a malformed one is answered with its error and counted
(``tool_call_valid_rate``).

The KV cache is kept across turns (:class:`~orbitctl.model.policy.Past`): a turn feeds only what its episode's
cache lacks (the last drawn token of the action, which the sampler never feeds back, and the environment's reply)
instead of reading the whole context again, at the same positions as the train path's full-sequence forward; tokens
the sampler fed past the action's end (after a plain-text action's newline) are struck out of the cache's mask.
Where a turn's batch holds episodes that were not decoded together (chunks that shift as episodes finish), or the
model records its routing (router replay), that batch reads its whole contexts again.
Draws are keyed per (episode, turn): row ``r`` (position ``p``, group index ``g``: ``r = p*G + g``)
samples turn ``t`` from key ``r * max_turns + t``, the same on 1 rank or N.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from orbitctl.rl.chat_turns import ChatTurns
from orbitctl.rl.envs import Environment, EpisodeItem
from orbitctl.rl.envs.tools import ToolCallError, parse_tool_call
from orbitctl.rl.rollout import RolloutBatch, lockstep_chunks


@dataclass
class Episode:
    """One episode being played: its context so far and what the policy contributed to it."""

    item: EpisodeItem
    env: Environment
    key: int | None
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    own: list[int] = field(default_factory=list)
    """1 where ``tokens`` holds a policy token, 0 on environment tokens."""
    logprobs: list[float] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    ret: float = 0.0
    done: bool = False
    turns: int = 0
    chat: ChatTurns | None = None
    """How turns are rendered under the chat template; None: plain text."""
    calls: int = 0
    """Actions read as tool calls (tool environments)."""
    valid_calls: int = 0
    fed: int = 0
    """Tokens of ``prompt + tokens`` that the episode's KV cache holds (the rest is fed at its next turn)."""

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


@functools.lru_cache(maxsize=4)
def _newline_ids(tokenizer) -> frozenset[int]:
    return frozenset(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))


def _encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _padded(rows: list[list], value, dtype):
    """Rows of different lengths as one right-padded [B, T] tensor."""
    import torch

    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


def _context_batch(rows: list[list[int]], pad: int):
    """Token rows of different lengths as one left-padded batch: ids and mask."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def _action(policy, ids: list[int], logps: list[float], chat: bool) -> tuple[list[int], list[float]]:
    """The sampled tokens up to and including the first EOS, or the first newline in a plain-text episode (a chat
    turn, a tool call's JSON say, may run over several lines)."""
    stops = {policy.eos_id} if chat else _newline_ids(policy.tokenizer) | {policy.eos_id}
    for i, token in enumerate(ids):
        if token in stops:
            return ids[:i + 1], logps[:i + 1]
    return ids, logps


def play(policy, episodes: list[Episode], *, batch_size: int, max_turns: int, max_new_tokens: int,
         temperature: float, top_p: float, generator, seed: int) -> None:
    """Play every episode to its end or ``max_turns`` actions, in place."""
    from orbitctl.model.draws import KeyedDraws

    carry = policy.routing is None  # router replay records each prefill's routing: it reads whole contexts
    kept: list[tuple[list[Episode], object]] = []  # the last turn's batches and their caches
    for turn in range(max_turns):
        active = [ep for ep in episodes if not ep.done]
        if policy.lockstep.all_done(not active):  # under expert parallelism every rank plays as many turns
            break
        caches, kept = kept, []
        for _, chunk in lockstep_chunks(policy, active, batch_size):
            past = _continued(caches, chunk) if chunk and carry else None
            if past is not None:
                ids, mask = _context_batch([ep.context[ep.fed:] for ep in chunk], policy.pad_id)
            else:
                ids, mask = _context_batch([ep.context for ep in chunk], policy.pad_id) if chunk else policy.filler()
            keyed = chunk and all(ep.key is not None for ep in chunk)
            draws = KeyedDraws(seed, tuple(ep.key * max_turns + turn for ep in chunk)) if keyed else None
            out = policy.sample(ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                generator=generator, draws=draws, past=past, keep_past=carry and bool(chunk))
            fed_steps = out.completion_ids.shape[1] - 1  # decode steps fed back: all but the last drawn token's
            for row, ep in enumerate(chunk):
                kept_steps = out.completion_mask[row].bool()
                action, logps = _action(policy, out.completion_ids[row][kept_steps].tolist(),
                                        out.logprobs[row][kept_steps].tolist(), ep.chat is not None)
                if out.past is not None:  # what the cache holds of this episode: its context and the fed action
                    held = min(len(action), fed_steps)
                    out.past.strike(row, out.past.mask.shape[1] - fed_steps + held)
                    ep.fed = len(ep.context) + held
                _played(policy, ep, action, logps, max_turns)
            if out.past is not None:
                kept.append((chunk, out.past))
    for ep in episodes:
        ep.env.close()


def _continued(caches: list[tuple[list[Episode], object]], chunk: list[Episode]):
    """The cache of the last turn that holds every episode of ``chunk``, its rows taken in the chunk's order; None
    when no one cache does (the batch then reads its contexts whole). A cache is continued once."""
    for i, (episodes, past) in enumerate(caches):
        rows = {id(ep): r for r, ep in enumerate(episodes)}
        if all(id(ep) in rows for ep in chunk):
            del caches[i]
            return past.rows([rows[id(ep)] for ep in chunk])
    return None


def _played(policy, ep: Episode, action: list[int], logps: list[float], max_turns: int) -> None:
    """The action's turn in the episode: the environment's answer, the return, and the reply's tokens appended
    unless the episode ended."""
    text = policy.tokenizer.decode(action, skip_special_tokens=True)
    (observation, reward, done), role = _respond(ep, text)
    ep.tokens += action
    ep.own += [1] * len(action)
    ep.logprobs += logps
    ep.transcript.append(text)
    ep.ret += float(reward)
    ep.turns += 1
    ep.done = bool(done) or ep.turns >= max_turns
    if not ep.done:  # the last reply is never read by the policy: it is not appended
        reply = _encode_text(policy.tokenizer, observation) if ep.chat is None else \
            ep.chat.answer(observation, role, closed=bool(action) and action[-1] == policy.eos_id)
        ep.tokens += reply
        ep.own += [0] * len(reply)
        ep.logprobs += [0.0] * len(reply)
        ep.transcript.append(observation)


def _respond(ep: Episode, text: str) -> tuple[tuple[str, float, bool], str]:
    """The environment's ``(observation, reward, done)`` for the action's text, and the role of its turn: a tool
    call (a malformed one answered with its error, nothing played) or a plain-text action."""
    if not ep.env.tools:
        return ep.env.step(text.replace("\n", "")), "user"
    ep.calls += 1
    call = parse_tool_call(text, ep.env.tools)
    if isinstance(call, ToolCallError):
        return (call.message, 0.0, False), "tool"
    ep.valid_calls += 1
    return ep.env.call(call.name, call.arguments), "tool"


def start_episodes(policy, env_cls: type[Environment], items: list[EpisodeItem], group_size: int,
                   positions=None) -> list[Episode]:
    """``group_size`` fresh episodes of each item's seed, keyed by position in the prompt stream."""
    chat = ChatTurns(policy.tokenizer, env_cls, policy.system_prompt) if policy.chat_template else None
    episodes = []
    for i, item in enumerate(items):
        for g in range(group_size):
            env = env_cls()
            observation = env.reset(item.seed)
            if chat is not None:
                prompt = chat.prompt(observation, env.demonstration())
            else:
                ids, mask = policy.encode_prompts([observation])
                prompt = ids[0][mask[0].bool()].tolist()
            key = positions[i] * group_size + g if positions is not None else None
            episodes.append(Episode(item, env, key, prompt, chat=chat))
    return episodes


def tool_call_counts(episodes: list[Episode]) -> tuple[int, int] | None:
    """``(valid, attempted)`` tool calls of the episodes; None when their environment has no tools."""
    if not episodes or not episodes[0].env.tools:
        return None
    return sum(ep.valid_calls for ep in episodes), sum(ep.calls for ep in episodes)


def collect_episodes(policy, env_cls: type[Environment], items: list[EpisodeItem], *, group_size: int,
                     batch_size: int, max_turns: int, max_new_tokens: int, temperature: float, top_p: float,
                     generator, keys=None) -> RolloutBatch:
    """One step's experience: ``group_size`` episodes per item; ``keys = (seed, positions)`` keys the draws."""
    import torch

    start = time.perf_counter()
    episodes = start_episodes(policy, env_cls, items, group_size, keys[1] if keys is not None else None)
    play(policy, episodes, batch_size=batch_size, max_turns=max_turns, max_new_tokens=max_new_tokens,
         temperature=temperature, top_p=top_p, generator=generator, seed=keys[0] if keys is not None else 0)
    pad = policy.pad_id
    width = max(len(ep.prompt) for ep in episodes)
    prompt_ids = torch.tensor([[pad] * (width - len(ep.prompt)) + ep.prompt for ep in episodes], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (width - len(ep.prompt)) + [1] * len(ep.prompt) for ep in episodes],
                               dtype=torch.long)
    completion_ids = _padded([ep.tokens for ep in episodes], pad, torch.long)
    completion_mask = _padded([ep.own for ep in episodes], 0, torch.long)
    attention = _padded([[1] * len(ep.tokens) for ep in episodes], 0, torch.long)
    logprobs = _padded([ep.logprobs for ep in episodes], 0.0, torch.float32)
    rewards = torch.tensor([ep.ret for ep in episodes], dtype=torch.float32)
    return RolloutBatch([ep.item for ep in episodes], prompt_ids, prompt_mask, completion_ids, completion_mask,
                        logprobs, None, ["".join(ep.transcript) for ep in episodes], rewards,
                        time.perf_counter() - start, 0.0, completion_attention=attention,
                        tool_calls=tool_call_counts(episodes))


def won(ep: Episode) -> bool:
    """The episode was completed: its return reached 1."""
    return ep.ret >= 1.0 - 1e-9


def evaluate_episodes(policy, env_cls: type[Environment], items: list[EpisodeItem], *, batch_size: int,
                      max_turns: int, max_new_tokens: int) -> dict:
    """Greedy play of held-out episodes: successes (return >= 1), episodes and summed return, for all-reduce, and
    (tool environments) the valid and attempted tool calls."""
    episodes = start_episodes(policy, env_cls, items, 1)
    play(policy, episodes, batch_size=batch_size, max_turns=max_turns, max_new_tokens=max_new_tokens,
         temperature=0.0, top_p=1.0, generator=None, seed=0)
    calls = tool_call_counts(episodes)
    return {"correct": float(sum(won(ep) for ep in episodes)), "total": len(episodes),
            "reward_sum": float(sum(ep.ret for ep in episodes)),
            **({"tool_calls_valid": calls[0], "tool_calls": calls[1]} if calls else {})}
