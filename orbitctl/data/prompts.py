"""Prompt sources: data files in any format :mod:`orbitctl.data.formats` reads, and builtin:NAME tasks.

Every record is checked before the run starts; a malformed one raises InputFileError naming
the file and line. The train stream is a seeded, per-epoch shuffle sharded by rank, with a
cursor that checkpoints save, so a resumed run sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from orbitctl.errors import UserError
from orbitctl.data.formats import read_items
from orbitctl.data.tasks import BuiltinTask, PromptItem, builtin_task, BUILTIN_TASKS


def read_jsonl(path: str | Path) -> list[PromptItem]:
    """The items of a data file, its format detected (:func:`~orbitctl.data.formats.read_items`)."""
    return read_items(path).items


@dataclass
class PromptSplit:
    train: list[PromptItem]
    eval: list[PromptItem]
    task: BuiltinTask | None
    formats: dict[str, str] = field(default_factory=dict)
    """The format each data file was read in, by profile key (``{"data.train": "gsm8k"}``)."""

    @property
    def warm_task(self) -> BuiltinTask:
        """The task a demo base of a tiny catalog model is warm-started on: the builtin task being trained,
        or for data files the echo task ``mod3`` (answer format: a short completion then EOS; reading
        digits from the prompt)."""
        return self.task if self.task is not None else builtin_task("mod3")


def load_prompts(data, seed: int) -> PromptSplit:
    """Train and held-out prompts from the profile's data section (files read in ``data.format``)."""
    task, formats = None, {}
    if data.train.startswith("builtin:"):
        task = builtin_task(data.train.split(":", 1)[1])
        if task is None:
            raise UserError(f"data.train: unknown builtin task '{data.train}'",
                            fix=f"use one of {', '.join('builtin:' + n for n in BUILTIN_TASKS)} or a data file")
        everything = task.items()
        train = [it for it in everything if not task.is_eval(it)]
        held_out = [it for it in everything if task.is_eval(it)]
    else:
        read = read_items(data.train, data.format)
        train, held_out, formats["data.train"] = read.items, [], read.format
    if data.eval and not data.eval.startswith("builtin:"):
        read = read_items(data.eval, data.format)
        held_out, formats["data.eval"] = read.items, read.format
    elif not data.eval and not held_out and data.eval_fraction > 0:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        cut = max(1, int(len(train) * data.eval_fraction)) if len(train) > 1 else 0
        held = set(order[:cut])
        held_out = [it for i, it in enumerate(train) if i in held]
        train = [it for i, it in enumerate(train) if i not in held]
    if not train:
        raise UserError(f"data.train: {data.train} leaves no training prompts after the held-out split",
                        fix="add prompts or lower data.eval_fraction")
    rng = random.Random(seed + 1)
    if len(held_out) > data.eval_size:
        held_out = rng.sample(held_out, data.eval_size)
    return PromptSplit(train, held_out, task, formats)


class PromptStream:
    """Seeded per-epoch shuffles of the train prompts; ``cursor`` counts prompts drawn so far."""

    def __init__(self, items: list[PromptItem], seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.items, self.seed, self.rank, self.world_size = items, seed, rank, world_size
        self.cursor = 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def next_batch(self, prompts_per_step: int) -> list[PromptItem]:
        """This rank's share of the next step's prompts (every rank advances the global cursor alike)."""
        return [item for _, item in self.next_step(prompts_per_step)]

    def next_step(self, prompts_per_step: int) -> list[tuple[int, PromptItem]]:
        """This rank's share of the next step's prompts, each with its position in the run's stream
        (the same prompt has the same position however many ranks share the step)."""
        n = len(self.items)
        picked = []
        for k in range(self.cursor, self.cursor + prompts_per_step):
            epoch, index = divmod(k, n)
            picked.append((k, self.items[self._order(epoch)[index]] if n else None))
        self.cursor += prompts_per_step
        return picked[self.rank::self.world_size]
