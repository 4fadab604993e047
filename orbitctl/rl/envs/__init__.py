"""Environments for multi-turn rollouts: ``data.train: env:NAME`` picks one.

An environment is a game the policy plays by text: :meth:`Environment.reset` starts the episode a
seed describes and returns the first observation (the prompt), :meth:`Environment.step` takes the
policy's action and answers with the next observation, a reward and whether the episode is over.
The same seed always gives the same episode, so G episodes of one seed form a GRPO group and a
resumed run replays what it would have played.

    from orbitctl.rl.envs import environment
    env = environment("env:guess")()
    obs = env.reset(7)                      # 'G:'
    obs, reward, done = env.step("4")       # ('H:', 0.0, False)

``guess`` (:mod:`.guess`) is small enough for the tiny CPU model; ``textworld`` (:mod:`.textworld_quest`)
is a TextWorld quest, generated offline from the seed (needs the ``textworld`` package).
"""

from __future__ import annotations

import random

from orbitctl.data.prompts import PromptSplit
from orbitctl.errors import UserError
from orbitctl.rl.envs.base import Environment, EpisodeItem
from orbitctl.rl.envs.guess import GuessDigit
from orbitctl.rl.envs.textworld_quest import TextWorldQuest

__all__ = ["ENVIRONMENTS", "Environment", "EpisodeItem", "environment", "episode_split", "env_name"]

ENVIRONMENTS: dict[str, type[Environment]] = {cls.name: cls for cls in (GuessDigit, TextWorldQuest)}
PREFIX = "env:"


def env_name(train: str) -> str | None:
    """``NAME`` of a ``data.train: env:NAME`` value, None for prompt data."""
    return train[len(PREFIX):] if train.startswith(PREFIX) else None


def environment(train: str) -> type[Environment]:
    """The environment class ``data.train`` names; an unknown name, or one whose package is missing, is refused."""
    cls = ENVIRONMENTS.get(env_name(train) or "")
    if cls is None:
        raise UserError(f"data.train: unknown environment '{train}'",
                        fix=f"use one of {', '.join(PREFIX + n for n in ENVIRONMENTS)}")
    cls.check_available()
    return cls


def episode_split(env: type[Environment], data, seed: int) -> PromptSplit:
    """Train and held-out episodes of ``env``: one :class:`EpisodeItem` per seed of its pool.

    ``data.eval_fraction`` of the pool (a seeded choice) is held out and never trained on; ``data.eval_size``
    of those are played greedily at each evaluation. ``data.eval`` and a reward other than ``builtin``
    have no meaning for an environment (its reward is the episode's return) and are refused, as is
    ``data.chat_template`` (replies are appended as plain text).
    """
    if data.eval is not None:
        raise UserError(f"data.eval: {data.eval} has no meaning with data.train: {data.train} "
                        f"(held-out episodes are held-out seeds)", fix="drop data.eval; data.eval_fraction sets the share")
    if data.chat_template:
        raise UserError(f"data.chat_template: true is not carried out for data.train: {data.train} (the "
                        f"environment's replies are appended as plain text, not as chat turns)",
                        fix="set data.chat_template: false for an environment run")
    if data.reward != "builtin":
        raise UserError(f"data.reward: {data.reward} has no meaning with data.train: {data.train} "
                        f"(the reward is the episode's return)", fix="set data.reward: builtin")
    order = list(range(env.seed_pool))
    random.Random(seed).shuffle(order)
    cut = max(1, int(len(order) * data.eval_fraction)) if data.eval_fraction > 0 else 0
    source = PREFIX + env.name
    held = sorted(order[:cut][:data.eval_size])
    train = [EpisodeItem(prompt="", seed=s, source=f"{source}#{s}") for s in sorted(order[cut:])]
    return PromptSplit(train, [EpisodeItem(prompt="", seed=s, source=f"{source}#{s}") for s in held], None)
