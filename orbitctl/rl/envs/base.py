"""The interface every environment implements, and the prompt-stream item that carries an episode's seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from orbitctl.data.tasks import PromptItem
from orbitctl.rl.envs.tools import Tool


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
    tools: ClassVar[tuple[Tool, ...]] = ()
    """Empty: actions are plain text (:meth:`step`). Else each action is a call of one of these tools
    (:mod:`.tools`), played by :meth:`call`; a malformed call is answered with its error, not played."""
    system: ClassVar[str] = ""
    """What the game is, for the system turn of a chat-format episode (with the tools, where the chat template
    has no tool specification of its own)."""
    example: ClassVar[tuple[str, dict]] = ("", {})
    """A call the system turn shows as the format of an action (tool environments)."""

    @classmethod
    def check_available(cls) -> None:
        """Raise :class:`~orbitctl.errors.UserError` when something the environment needs is missing."""

    @classmethod
    def variant(cls, options: str) -> type["Environment"]:
        """The environment ``env:NAME-OPTIONS`` names (a quest family, a level); none by default."""
        raise ValueError(f"{cls.name}-{options}: {cls.name} takes no options")

    def reset(self, seed: int) -> str:
        """Start the episode ``seed`` describes; returns the first observation."""
        raise NotImplementedError

    def step(self, action: str) -> tuple[str, float, bool]:
        """Play ``action`` (the policy's text, newline and special tokens removed); returns
        ``(observation, reward, done)``."""
        raise NotImplementedError

    def call(self, name: str, arguments: dict) -> tuple[str, float, bool]:
        """Play a well-formed call of one of :attr:`tools`; returns ``(observation, reward, done)``."""
        raise NotImplementedError

    def demonstration(self) -> list[dict]:
        """A solved episode of another seed as chat turns (user, assistant, tool, ...) that a chat-format episode
        shows before its own first observation, as ALFWorld's ReAct prompts show solved examples; none by default."""
        return []

    def close(self) -> None:
        """Release what the episode holds (a game interpreter, say); nothing by default."""
