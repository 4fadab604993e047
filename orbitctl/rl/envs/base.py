"""The interface every environment implements, and the prompt-stream item that carries an episode's seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from orbitctl.data.tasks import PromptItem


@dataclass(frozen=True)
class EpisodeItem(PromptItem):
    """One episode in the run's prompt stream: the stream shuffles, shards and resumes these like prompts."""

    seed: int = 0
    """The episode: ``reset(seed)`` starts it."""


class Environment:
    """A text game: one instance plays one episode at a time."""

    name: ClassVar[str]
    """What ``data.train: env:NAME`` calls it."""
    turn_limit: ClassVar[int]
    """Turns a good policy needs at most: a hint for ``rollout.max_turns``."""
    seed_pool: ClassVar[int]
    """Distinct episodes (seeds ``0 .. seed_pool-1``) the train and held-out splits are drawn from."""

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`~orbitctl.errors.UserError` when something the environment needs is missing."""

    def reset(self, seed: int) -> str:
        """Start the episode ``seed`` describes; returns the first observation."""
        raise NotImplementedError

    def step(self, action: str) -> tuple[str, float, bool]:
        """Play ``action`` (the policy's text, newline and special tokens removed); returns
        ``(observation, reward, done)``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (a game interpreter, say); nothing by default."""
