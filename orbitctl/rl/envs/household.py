"""``env:household``: household quests of ALFWorld's six kinds, played by tool calls.

``env:household`` mixes the six kinds at level 1; ``env:household-KIND`` (pick, light, clean, heat, cool, pick2)
plays one kind, ``env:household-KIND-LEVEL`` (or ``env:household-LEVEL``) one level of 1-3
(:mod:`.household_world` generates the games). The first observation is the task and the start room, and every
observation ends with the calls that would do something there ("Possible calls: take(mug), go(kitchen)."); each
action is one call of the game's tools (``go``, ``open``, ``take``, ``put``, ``look``, and the kind's own:
``clean``, ``heat``, ``cool`` or ``use``); the reward is 1 when the task is done, which ends the episode.

    env = environment("env:household-clean-1")()
    env.reset(4)    # 'Your task is to: put a clean spoon in the cabinet.\\nYou are in the kitchen. ...'
    env.call("take", {"object": "spoon"})   # ('You take the spoon from the countertop.\\n...', 0.0, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from orbitctl.rl.envs.base import Environment
from orbitctl.rl.envs.household_world import (ADJECTIVE, APPLIANCE, CLOSED, KINDS, LAMPS, LEVELS, ROOMS, Quest,
                                              make_quest, preposition)
from orbitctl.rl.envs.tools import Tool, format_call

_OBJECT = {"object": "string"}
BASE_TOOLS = (
    Tool("go", "Walk to another room.", {"room": "string"}),
    Tool("open", "Open a closed receptacle in this room.", {"receptacle": "string"}),
    Tool("take", "Pick up an object you can see (you hold one at a time).", _OBJECT),
    Tool("put", "Put the object you hold on or in a receptacle of this room.", {"object": "string",
                                                                                  "receptacle": "string"}),
    Tool("look", "Describe this room again."),
)
KIND_TOOLS = {
    "clean": Tool("clean", "Clean the object you hold (needs a sinkbasin in the room).", _OBJECT),
    "heat": Tool("heat", "Heat the object you hold (needs the microwave in the room).", _OBJECT),
    "cool": Tool("cool", "Cool the object you hold (needs the fridge in the room).", _OBJECT),
    "light": Tool("use", "Turn on a lamp in this room.", _OBJECT),
}
DEMO_SEED = -1
"""The quest of the demonstration: no seed of the pool (``0 .. seed_pool-1``)."""
TURN_LIMITS = {1: 6, 2: 10, 3: 16}
"""Actions an episode may take at each level: the longest walkthrough (4, 7, 11) and some slack."""


@dataclass
class _Item:
    name: str
    states: set[str] = field(default_factory=set)
    """``clean``, ``hot``, ``cool`` once treated; ``placed`` once the player put it down."""


def _listed(names: list[str]) -> str:
    return ", ".join(f"a {n}" for n in names)


class HouseholdQuest(Environment):
    """A generated household quest (kind and level from the environment's name)."""

    name: ClassVar[str] = "household"
    kind: ClassVar[str] = "all"
    level: ClassVar[int] = 1
    turn_limit: ClassVar[int] = TURN_LIMITS[1]
    seed_pool: ClassVar[int] = 10_000
    tools: ClassVar[tuple[Tool, ...]] = BASE_TOOLS + tuple(KIND_TOOLS.values())
    system: ClassVar[str] = "You are a household robot in a small house. Do the task you are given."
    example: ClassVar[tuple[str, dict]] = ("take", {"object": "apple"})

    @classmethod
    def variant(cls, options: str) -> type[Environment]:
        """``KIND``, ``LEVEL`` or ``KIND-LEVEL``: a subclass that plays those quests only."""
        parts = options.split("-")
        kind = parts.pop(0) if parts and parts[0] in KINDS else "all"
        level = int(parts.pop(0)) if parts and parts[0].isdigit() else 1
        if parts or level not in LEVELS:
            raise ValueError(f"household-{options}: expected household-KIND-LEVEL, KIND one of {', '.join(KINDS)} "
                             f"and LEVEL one of {', '.join(map(str, LEVELS))}")
        tools = BASE_TOOLS + ((KIND_TOOLS[kind],) if kind in KIND_TOOLS else ()) if kind != "all" else cls.tools
        return type(cls.__name__, (cls,), {"name": f"{cls.name}-{options}", "kind": kind, "level": level,
                                           "turn_limit": TURN_LIMITS[level], "tools": tools})

    def __init__(self) -> None:
        self.quest: Quest | None = None
        self.done = self.won = True

    def reset(self, seed: int) -> str:
        self.quest = quest = make_quest(seed, kind=self.kind, level=self.level)
        self.here, self.held = quest.start, None
        self.contents = {spot: [_Item(n) for n in names] for spot, names in quest.contents.items()}
        self.closed = set(quest.closed)
        self.done = self.won = False
        return f"Your task is to: {quest.goal}.\n{self.describe()}\n{self.admissible()}"

    def demonstration(self) -> list[dict]:
        """The walkthrough of a quest of the same kind and level from outside the seed pool (seed -1), played."""
        demo = type(self)()
        turns = [{"role": "user", "content": demo.reset(DEMO_SEED)}]
        for name, arguments in demo.quest.walkthrough:
            turns += [{"role": "assistant", "content": format_call(name, arguments)},
                      {"role": "tool", "content": demo.call(name, arguments)[0]}]
        return turns

    # -- what the player sees ------------------------------------------------------------
    def describe(self) -> str:
        """The room the player is in: its receptacles with what lies on the open ones, and the other rooms."""
        seen = []
        for rec, _ in ROOMS[self.here]:
            spot = (self.here, rec)
            if spot in self.closed:
                seen.append(f"a closed {rec}")
            else:
                items = [i.name for i in self.contents.get(spot, [])]
                seen.append(f"a {rec}" + (f" ({', '.join(items)})" if items else ""))
        lamp = LAMPS.get(self.here)
        if lamp:
            seen.append(f"a {lamp}")
        others = [room for room in self.quest.rooms if room != self.here]
        exits = f" Other rooms: {', '.join(others)}." if others else ""
        return f"You are in the {self.here}. You see {', '.join(seen)}.{exits}"

    def _receptacle(self, name: str) -> tuple[str, str] | None:
        return (self.here, name) if any(r == name for r, _ in ROOMS[self.here]) else None

    def _visible(self, name: str) -> tuple[tuple[str, str], _Item] | None:
        """An object of that name in sight: one the player has not put down, where there is such a one."""
        seen = [(spot, item) for spot in ((self.here, rec) for rec, _ in ROOMS[self.here]) if spot not in self.closed
                for item in self.contents.get(spot, []) if item.name == name]
        return min(seen, key=lambda found: "placed" in found[1].states, default=None)

    def _won(self) -> bool:
        quest = self.quest
        placed = [i for (room, rec), items in self.contents.items() if rec == quest.target for i in items
                  if i.name == quest.object and (quest.kind not in ADJECTIVE or ADJECTIVE[quest.kind] in i.states)]
        return len(placed) >= (2 if quest.kind == "pick2" else 1)

    # -- the tools -----------------------------------------------------------------------
    def call(self, name: str, arguments: dict) -> tuple[str, float, bool]:
        if self.done:
            raise RuntimeError("call() after the episode ended: call reset() first")
        text = getattr(self, f"_{name}")(**arguments)
        if self.won:
            self.done = True
            return f"{text} Task complete.", 1.0, True
        return f"{text}\n{self.admissible()}", 0.0, False

    def admissible(self) -> str:
        """The calls that would do something here, as verl-agent's ALFWorld prompt lists the admissible actions."""
        tools = {t.name for t in self.tools}
        calls = [f"go({room})" for room in self.quest.rooms if room != self.here]
        open_here = [rec for rec, _ in ROOMS[self.here] if (self.here, rec) not in self.closed]
        calls += [f"open({rec})" for rec, _ in ROOMS[self.here] if (self.here, rec) in self.closed]
        if self.held is None:
            calls += [f"take({item.name})" for rec in open_here for item in self.contents.get((self.here, rec), [])]
        else:
            calls += [f"put({self.held.name}, {rec})" for rec in open_here]
            calls += [f"{kind}({self.held.name})" for kind, appliance in APPLIANCE.items()
                      if kind in tools and any(r == appliance for r, _ in ROOMS[self.here])]
        if "use" in tools and self.here in LAMPS:
            calls.append(f"use({LAMPS[self.here]})")
        return f"Possible calls: {', '.join(dict.fromkeys(calls))}."

    def _go(self, room: str) -> str:
        if room == self.here:
            return f"You are already in the {room}."
        if room not in self.quest.rooms:
            return f"There is no {room} in this house. Rooms: {', '.join(self.quest.rooms)}."
        self.here = room
        return self.describe()

    def _open(self, receptacle: str) -> str:
        spot = self._receptacle(receptacle)
        if spot is None:
            return f"There is no {receptacle} in the {self.here}."
        if dict(ROOMS[self.here])[receptacle] != CLOSED:
            return f"The {receptacle} does not open."
        if spot not in self.closed:
            return f"The {receptacle} is already open."
        self.closed.discard(spot)
        items = [i.name for i in self.contents.get(spot, [])]
        return f"You open the {receptacle}. " + (f"In it: {_listed(items)}." if items else "It is empty.")

    def _take(self, object: str) -> str:  # noqa: A002 - the tool's argument name
        if self.held is not None:
            return f"You already hold the {self.held.name}. Put it somewhere first."
        found = self._visible(object)
        if found is None:
            return f"You see no {object} here."
        spot, item = found
        self.contents[spot].remove(item)
        self.held = item
        return f"You take the {object} from the {spot[1]}."

    def _holding(self, name: str) -> str | None:
        """Why the player cannot act on ``name`` with what it holds; None when it holds it."""
        if self.held is None:
            return f"You hold nothing. Take the {name} first."
        if self.held.name != name:
            return f"You do not hold a {name}. You hold the {self.held.name}."
        return None

    def _put(self, object: str, receptacle: str) -> str:  # noqa: A002
        refused = self._holding(object)
        spot = self._receptacle(receptacle)
        if refused or spot is None:
            return refused or f"There is no {receptacle} in the {self.here}."
        if spot in self.closed:
            return f"The {receptacle} is closed."
        self.held.states.add("placed")
        self.contents.setdefault(spot, []).append(self.held)
        self.held = None
        self.won = self._won()
        return f"You put the {object} {preposition(receptacle)} the {receptacle}."

    def _treat(self, kind: str, name: str) -> str:
        appliance = APPLIANCE[kind]
        refused = self._holding(name)
        if refused or self._receptacle(appliance) is None:
            return refused or f"There is no {appliance} in the {self.here}."
        self.held.states.add(ADJECTIVE[kind])
        return f"You {kind} the {name} with the {appliance}."

    def _clean(self, object: str) -> str:  # noqa: A002
        return self._treat("clean", object)

    def _heat(self, object: str) -> str:  # noqa: A002
        return self._treat("heat", object)

    def _cool(self, object: str) -> str:  # noqa: A002
        return self._treat("cool", object)

    def _use(self, object: str) -> str:  # noqa: A002
        if LAMPS.get(self.here) != object:
            return f"There is no {object} to turn on in the {self.here}."
        text = f"You turn on the {object}."
        quest = self.quest
        if quest.kind == "light" and quest.lamp == object and self.held is not None and self.held.name == quest.object:
            self.won = True
            return f"{text} You look at the {quest.object} under the {object}."
        return text

    def _look(self) -> str:
        return self.describe() + (f" You hold the {self.held.name}." if self.held else "")
