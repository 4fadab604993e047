"""Household quests of ALFWorld's six task kinds, generated from a seed: the house, the task, a walkthrough.

ALFWorld (Shridhar et al. 2021) sets household tasks in TextWorld games made from ALFRED scenes. Its six kinds
are made here from the seed alone, with no download and no game compiler:

| kind | task | what winning takes |
|---|---|---|
| ``pick`` | put a mug on the desk | take it, put it on the receptacle |
| ``light`` | look at the book under the desklamp | take it, turn the lamp on (in the lamp's room) |
| ``clean`` | put a clean spoon in the drawer | take it, clean it (a room with a sinkbasin), put it |
| ``heat`` | put a hot potato on the diningtable | take it, heat it (the microwave), put it |
| ``cool`` | put a cool tomato on the countertop | take it, cool it (the fridge), put it |
| ``pick2`` | put two cds on the shelf | take, put, take the second, put |

The level sets how far the player must search: **1**, one room with everything in sight; **2**, two rooms, the
object in the one the player does not start in; **3**, three rooms, the object shut inside a closed receptacle
somewhere other than the start, and more objects around it. The same seed always gives the same game.

    quest = make_quest(12, kind="clean", level=2)
    quest.goal          # 'put a clean spoon in the drawer'
    quest.walkthrough   # [('go', {'room': 'kitchen'}), ('take', {'object': 'spoon'}), ...]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("pick", "light", "clean", "heat", "cool", "pick2")
LEVELS = (1, 2, 3)

CLOSED = "closed"
ROOMS: dict[str, tuple[tuple[str, str], ...]] = {
    # (receptacle, state): "closed" ones hide what they hold until opened; "" ones are open surfaces
    "kitchen": (("countertop", ""), ("diningtable", ""), ("cabinet", CLOSED), ("fridge", CLOSED),
                ("microwave", CLOSED), ("sinkbasin", ""), ("stoveburner", "")),
    "bedroom": (("bed", ""), ("desk", ""), ("dresser", ""), ("drawer", CLOSED), ("shelf", "")),
    "livingroom": (("sofa", ""), ("coffeetable", ""), ("sidetable", ""), ("armchair", ""), ("tvstand", "")),
    "bathroom": (("countertop", ""), ("cabinet", CLOSED), ("sinkbasin", ""), ("towelholder", ""),
                 ("toilet", "")),
}
LAMPS = {"bedroom": "desklamp", "livingroom": "floorlamp"}
APPLIANCE = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}
ADJECTIVE = {"clean": "clean", "heat": "hot", "cool": "cool"}
OBJECTS: dict[str, tuple[str, ...]] = {
    # the objects each kind's task may ask for (ALFWorld's own lists, shortened)
    "pick": ("mug", "book", "pen", "cd", "cellphone", "keychain", "pillow", "remotecontrol", "creditcard", "vase",
             "soapbar", "towel", "candle", "plate", "bowl"),
    "light": ("book", "pen", "cd", "cellphone", "keychain", "creditcard", "vase", "alarmclock", "watch"),
    "clean": ("mug", "cup", "plate", "bowl", "spoon", "knife", "fork", "pan", "apple", "cloth", "soapbar"),
    "heat": ("apple", "tomato", "potato", "egg", "bread", "mug", "cup", "plate"),
    "cool": ("apple", "tomato", "potato", "egg", "lettuce", "bread", "mug", "cup", "pan", "bowl"),
    "pick2": ("mug", "book", "pen", "cd", "cellphone", "keychain", "pillow", "creditcard", "soapbar", "candle"),
}
DISTRACTORS = ("apple", "book", "pen", "cd", "mug", "cup", "plate", "spoon", "towel", "candle", "vase", "egg",
               "keychain", "pillow", "bowl", "knife", "watch", "tomato", "cloth", "newspaper")
TARGETS_OF_KIND = {
    # receptacles a task may name as where the object goes; the appliance a task needs is never one of them
    "pick": ("desk", "shelf", "dresser", "sidetable", "coffeetable", "countertop", "diningtable", "cabinet",
             "drawer", "sofa", "bed", "armchair"),
    "clean": ("countertop", "diningtable", "cabinet", "drawer", "shelf", "sidetable"),
    "heat": ("countertop", "diningtable", "cabinet", "fridge", "stoveburner", "coffeetable"),
    "cool": ("countertop", "diningtable", "cabinet", "microwave", "stoveburner", "coffeetable"),
    "pick2": ("desk", "shelf", "dresser", "sidetable", "coffeetable", "countertop", "diningtable", "sofa", "bed"),
}
IN_PREPOSITION = ("cabinet", "drawer", "fridge", "microwave", "sinkbasin")


def preposition(receptacle: str) -> str:
    """``in`` for what holds things inside, ``on`` for surfaces."""
    return "in" if receptacle in IN_PREPOSITION else "on"


@dataclass
class Quest:
    """One generated game: where everything starts, what to do, and one shortest way to do it."""

    kind: str
    level: int
    rooms: list[str]
    start: str
    contents: dict[tuple[str, str], list[str]]
    """(room, receptacle) -> the objects on or in it."""
    closed: set[tuple[str, str]]
    object: str
    target: str | None
    """The receptacle the object goes to (None for ``light``, whose goal is a lamp)."""
    lamp: str | None = None
    goal: str = ""
    walkthrough: list[tuple[str, dict]] = field(default_factory=list)


def _rooms_with(receptacle: str) -> list[str]:
    return [room for room, recs in ROOMS.items() if any(r == receptacle for r, _ in recs)]


def _surfaces(rooms: list[str], *, closed: bool) -> list[tuple[str, str]]:
    return [(room, rec) for room in rooms for rec, state in ROOMS[room] if (state == CLOSED) == closed]


def _house(kind: str, level: int, rng: random.Random) -> tuple[list[str], str | None, str | None]:
    """``(rooms, target, lamp)``: the rooms the level has, with every one the task needs among them."""
    lamp_room = rng.choice(sorted(LAMPS)) if kind == "light" else None
    special = lamp_room or {"heat": "kitchen", "cool": "kitchen"}.get(kind) or (
        rng.choice(("kitchen", "bathroom")) if kind == "clean" else None)
    targets = TARGETS_OF_KIND.get(kind, ())
    if level == 1:  # one room holds everything
        room = special or rng.choice(sorted(r for r in ROOMS if any(t in targets for t in dict(ROOMS[r]))))
        choices = [t for t in dict(ROOMS[room]) if t in targets and t != APPLIANCE.get(kind)]
        return [room], rng.choice(choices) if targets else None, LAMPS.get(lamp_room)
    target = rng.choice(targets) if targets else None
    needed = [r for r in (special,) if r]
    if target and not any(r in _rooms_with(target) for r in needed):
        needed.append(rng.choice(_rooms_with(target)))
    others = [room for room in ROOMS if room not in needed]
    rng.shuffle(others)
    return sorted(needed + others[:max(0, level - len(needed))]), target, LAMPS.get(lamp_room)


def make_quest(seed: int, *, kind: str, level: int) -> Quest:
    """The game of ``seed`` for one task ``kind`` (or ``all``: the seed picks the kind) at ``level`` 1-3."""
    if kind != "all" and kind not in KINDS or level not in LEVELS:
        raise ValueError(f"no household quest of kind {kind!r} at level {level}")
    rng = random.Random(f"household:{kind}:{level}:{seed}")
    kind = rng.choice(KINDS) if kind == "all" else kind
    obj = rng.choice(OBJECTS[kind])
    rooms, target, lamp = _house(kind, level, rng)
    start = rng.choice(rooms)
    # where the object starts: in sight (level 1: the start room; level 2: another room), shut inside a closed
    # receptacle of another room at level 3; never where it must go, never in the appliance it needs
    away = [room for room in rooms if room != start] if level >= 2 else rooms
    unusable = {target, APPLIANCE.get(kind), "fridge", "microwave"}
    places = [p for p in _surfaces(away, closed=level >= 3) if p[1] not in unusable] or \
        [p for p in _surfaces(away, closed=False) if p[1] not in unusable]
    spots = rng.sample(places, 2) if kind == "pick2" and len(places) > 1 else [rng.choice(places)] * (
        2 if kind == "pick2" else 1)
    contents: dict[tuple[str, str], list[str]] = {}
    for spot in spots:
        contents.setdefault(spot, []).append(obj)
    in_sight = _surfaces(rooms, closed=False)
    for _ in range({1: 1, 2: 2, 3: 4}[level]):  # other objects, never the one the task asks for
        contents.setdefault(rng.choice(in_sight), []).append(rng.choice([d for d in DISTRACTORS if d != obj]))
    quest = Quest(kind, level, rooms, start, contents, set(_surfaces(rooms, closed=True)), obj, target, lamp)
    quest.goal = goal_text(quest)
    quest.walkthrough = walkthrough(quest, spots)
    return quest


def goal_text(quest: Quest) -> str:
    """The task in ALFWorld's words."""
    if quest.kind == "light":
        return f"look at the {quest.object} under the {quest.lamp}"
    where = f"{preposition(quest.target)} the {quest.target}"
    if quest.kind == "pick2":
        return f"put two {quest.object}s {where}"
    adjective = ADJECTIVE.get(quest.kind)
    return f"put a {adjective + ' ' if adjective else ''}{quest.object} {where}"


def _room_of(quest: Quest, receptacle: str) -> str:
    return next(room for room in quest.rooms if any(r == receptacle for r, _ in ROOMS[room]))


def walkthrough(quest: Quest, spots: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """A shortest winning sequence of tool calls."""
    steps: list[tuple[str, dict]] = []
    here = quest.start
    opened: set[tuple[str, str]] = set()

    def go(room: str) -> None:
        nonlocal here
        if room != here:
            steps.append(("go", {"room": room}))
            here = room

    def open_(place: tuple[str, str]) -> None:
        if place in quest.closed and place not in opened:
            steps.append(("open", {"receptacle": place[1]}))
            opened.add(place)

    target_room = _room_of(quest, quest.target) if quest.target else None
    for spot in spots:
        go(spot[0])
        open_(spot)
        steps.append(("take", {"object": quest.object}))
        if quest.kind in APPLIANCE:
            appliance = APPLIANCE[quest.kind]
            go(here if any(r == appliance for r, _ in ROOMS[here]) else _room_of(quest, appliance))
            steps.append((quest.kind, {"object": quest.object}))
        if quest.kind == "light":
            go(next(room for room, lamp in LAMPS.items() if lamp == quest.lamp))
            steps.append(("use", {"object": quest.lamp}))
            return steps
        target = (here if any(r == quest.target for r, _ in ROOMS[here]) else target_room, quest.target)
        go(target[0])
        open_(target)
        steps.append(("put", {"object": quest.object, "receptacle": quest.target}))
    return steps
