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
is a TextWorld quest, generated offline from the seed (needs the ``textworld`` package); ``household``
(:mod:`.household`) is a household quest of ALFWorld's kinds, played by tool calls (:mod:`.tools`), and takes
options after a dash (``env:household-clean-2``: one kind, one level).
"""

from __future__ import annotations

import random

from orbitctl.data.prompts import PromptSplit
from orbitctl.errors import UserError
from orbitctl.rl.envs.base import Environment, EpisodeItem
from orbitctl.rl.envs.guess import GuessDigit
from orbitctl.rl.envs.household import HouseholdQuest
from orbitctl.rl.envs.textworld_quest import TextWorldQuest

__all__ = ["ENVIRONMENTS", "Environment", "EpisodeItem", "environment", "episode_split", "env_name",
           "held_out_seeds"]

ENVIRONMENTS: dict[str, type[Environment]] = {cls.name: cls for cls in (GuessDigit, TextWorldQuest, HouseholdQuest)}
PREFIX = "env:"


def env_name(train: str) -> str | None:
    """``NAME`` of a ``data.train: env:NAME`` value, None for prompt data."""
    return train[len(PREFIX):] if train.startswith(PREFIX) else None


def environment(train: str) -> type[Environment]:
    """The environment class ``data.train`` names (``env:NAME`` or ``env:NAME-OPTIONS``); an unknown name, bad
    options, or an environment whose package is missing, is refused."""
    base, _, options = (env_name(train) or "").partition("-")
    cls = ENVIRONMENTS.get(base)
    if cls is None:
        raise UserError(f"data.train: unknown environment '{train}'",
                        fix=f"use one of {', '.join(PREFIX + n for n in ENVIRONMENTS)}")
    cls.check_available()
    if options:
        try:
            cls = cls.variant(options)
        except ValueError as err:
            raise UserError(f"data.train: {train}: {err}", fix=f"see the options of {PREFIX}{base} in docs/train.md") \
                from None
    return cls


def held_out_seeds(env: type[Environment], data, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held_out)``: the environment's seed pool split in two disjoint pools.

    ``data.eval_fraction`` of the pool (a choice seeded by ``seed``, the run's) is held out and never trained on;
    the train seeds come sorted, the held-out ones in the seeded order (the first N are a random N of them)."""
    order = list(range(env.seed_pool))
    random.Random(seed).shuffle(order)
    cut = max(1, int(len(order) * data.eval_fraction)) if data.eval_fraction > 0 else 0
    return sorted(order[cut:]), order[:cut]


def episode_split(env: type[Environment], data, seed: int) -> PromptSplit:
    """Train and held-out episodes of ``env``: one :class:`EpisodeItem` per seed of its pool.

    The pools are :func:`held_out_seeds`'; ``data.eval_size`` of the held-out seeds are played greedily at each
    evaluation. ``data.eval`` and a reward other than ``builtin`` have no meaning for an environment (its reward
    is the episode's return) and are refused, as is a tool environment without ``data.chat_template`` (its
    actions are tool calls in the chat template's format).
    """
    if data.eval is not None:
        raise UserError(f"data.eval: {data.eval} has no meaning with data.train: {data.train} "
                        f"(held-out episodes are held-out seeds)", fix="drop data.eval; data.eval_fraction sets the share")
    if env.tools and not data.chat_template:
        raise UserError(f"data.chat_template: false, and data.train: {data.train} is played by tool calls, which "
                        f"are chat turns", fix="set data.chat_template: true")
    if data.reward != "builtin":
        raise UserError(f"data.reward: {data.reward} has no meaning with data.train: {data.train} "
                        f"(the reward is the episode's return)", fix="set data.reward: builtin")
    train, held = held_out_seeds(env, data, seed)
    return PromptSplit(episode_items(env, train), episode_items(env, sorted(held[:data.eval_size])), None)


def episode_items(env: type[Environment], seeds: list[int]) -> list[EpisodeItem]:
    """One prompt-stream item per seed, named ``env:NAME#SEED``."""
    return [EpisodeItem(prompt="", seed=s, source=f"{PREFIX}{env.name}#{s}") for s in seeds]
