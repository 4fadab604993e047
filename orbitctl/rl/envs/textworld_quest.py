"""``env:textworld``: a two-room TextWorld quest generated offline from the seed.

The seed picks the rooms, the direction between them, the key, the container and the prize; the
quest is always: take the key, go to the other room, unlock the container, open it, take the prize
(five commands, reward 1 when done; a parser answers anything else, e.g. "You can't go that way.").
The game is compiled once per seed with TextWorld's Inform 7 tool chain (seconds) and kept under
``$ORBITCTL_CACHE/textworld``; playing it costs milliseconds a step. Needs ``pip install textworld``.
"""

from __future__ import annotations

import importlib.util
import random
import re
from pathlib import Path
from typing import ClassVar

from orbitctl.errors import UserError
from orbitctl.rl.envs.base import Environment

ROOMS = ("kitchen", "pantry", "cellar", "study", "attic", "garage", "library", "workshop")
DIRECTIONS = (("east", "west"), ("north", "south"))
KEYS = ("brass key", "iron key", "silver key", "rusty key")
CONTAINERS = ("wooden chest", "metal box", "old trunk", "small safe")
PRIZES = ("coin", "ring", "map", "gem")
GAME_FILE = "quest.z8"


def quest_layout(seed: int) -> dict:
    """The quest's names and its winning commands, from the seed alone."""
    rng = random.Random(seed)
    start, other = rng.sample(ROOMS, 2)
    there, back = rng.choice(DIRECTIONS)[::rng.choice((1, -1))]
    key, container, prize = rng.choice(KEYS), rng.choice(CONTAINERS), rng.choice(PRIZES)
    return {"start": start, "other": other, "there": there, "back": back, "key": key, "container": container,
            "prize": prize, "walkthrough": [f"take {key}", f"go {there}", f"unlock {container} with {key}",
                                            f"open {container}", f"take {prize}"]}


def _compile(seed: int, directory: Path) -> None:
    from textworld import GameMaker, GameOptions

    layout = quest_layout(seed)
    options = GameOptions()
    options.seeds = seed  # the generated text (intro, room descriptions) follows the seed too
    maker = GameMaker(options)
    start, other = maker.new_room(layout["start"]), maker.new_room(layout["other"])
    maker.connect(getattr(start, layout["there"]), getattr(other, layout["back"]))
    maker.set_player(start)
    key = maker.new(type="k", name=layout["key"])
    start.add(key)
    container = maker.new(type="c", name=layout["container"])
    container.add_property("locked")
    other.add(container)
    maker.add_fact("match", key, container)
    container.add(maker.new(type="o", name=layout["prize"]))
    maker.set_quest_from_commands(layout["walkthrough"])
    maker.compile(str(directory / GAME_FILE))


def game_file(seed: int) -> Path:
    """The compiled game of ``seed``, compiled into the cache on first use."""
    from orbitctl.builder import cache_root
    from orbitctl.rundir import atomic_dir

    final = cache_root() / "textworld" / f"quest-{seed}"
    if not (final / GAME_FILE).exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        atomic_dir(final, lambda tmp: _compile(seed, tmp))
    return final / GAME_FILE


def clean(feedback: str) -> str:
    """TextWorld's text without its banner, prompt line and runs of blank lines."""
    text = feedback.split("\n>")[0]
    return re.sub(r"\n\s*\n+", "\n", text).strip()


class TextWorldQuest(Environment):
    """Take the key, unlock the container in the next room, take the prize."""

    name: ClassVar[str] = "textworld"
    turn_limit: ClassVar[int] = 8
    seed_pool: ClassVar[int] = 1000

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("textworld") is None:
            raise UserError("data.train: env:textworld needs the textworld package, which is not installed",
                            fix="pip install 'textworld>=1.7,<2', or use env:guess")

    def __init__(self) -> None:
        import textworld

        self._textworld = textworld
        self._game = None
        self._score = 0

    def reset(self, seed: int) -> str:
        self.close()
        infos = self._textworld.EnvInfos(description=True, objective=True, max_score=True, won=True, lost=True)
        self._game = self._textworld.start(str(game_file(seed)), request_infos=infos)
        state = self._game.reset()
        self._score, self._max = 0, max(int(state.max_score or 1), 1)
        return f"{state.objective}\n{clean(state.description)}\n"

    def step(self, action: str) -> tuple[str, float, bool]:
        if self._game is None:
            raise RuntimeError("step() before reset()")
        state, score, done = self._game.step(action.strip() or "look")
        reward = (score - self._score) / self._max
        self._score = score
        return clean(state.feedback) + "\n", float(reward), bool(done)

    def close(self) -> None:
        """Stop the game's interpreter."""
        if self._game is not None:
            self._game.close()
            self._game = None
