"""Prompt sources: JSONL files (prompt + answer, or prompt + tests) and builtin:NAME tasks.

Every line is checked before the run starts; a malformed one raises InputFileError naming
the file and line. The train stream is a seeded, per-epoch shuffle sharded by rank, with a
cursor that checkpoints save, so a resumed run sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import InputFileError, UserError
from orbitctl.rundir import jsonl_records
from orbitctl.data.tasks import BuiltinTask, PromptItem, builtin_task, BUILTIN_TASKS


def read_jsonl(path: str | Path) -> list[PromptItem]:
    """Parse and validate every line; the first bad one is an error naming file and line."""
    path = Path(path)
    if not path.exists():
        raise InputFileError(f"{path}: file not found", fix="set data.train/data.eval to an existing JSONL file or builtin:NAME")
    items: list[PromptItem] = []
    for number, _, record, error, column in jsonl_records(path):
        where = f"{path}:{number}"
        if record is None:
            raise InputFileError(f"{where}: not valid JSON ({error} at column {column})",
                                 fix="each line must be one JSON object")
        if not isinstance(record, dict):
            raise InputFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
        prompt = record.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise InputFileError(f"{where}: missing 'prompt' (a non-empty string)")
        answer, tests = record.get("answer"), record.get("tests")
        if answer is None and tests is None:
            raise InputFileError(f"{where}: needs 'answer' (math/builtin rewards) or 'tests' (code reward)")
        if tests is not None and not isinstance(tests, str):
            raise InputFileError(f"{where}: 'tests' must be a string of Python test code")
        entry = record.get("entry_point")
        if entry is not None and not isinstance(entry, str):
            raise InputFileError(f"{where}: 'entry_point' must be a string")
        items.append(PromptItem(prompt=prompt, answer=None if answer is None else str(answer), tests=tests,
                                entry_point=entry, source=where))
    if not items:
        raise InputFileError(f"{path}: no prompts", fix="add one JSON object per line with a 'prompt' key")
    return items


@dataclass
class PromptSplit:
    train: list[PromptItem]
    eval: list[PromptItem]
    task: BuiltinTask | None

    @property
    def warm_task(self) -> BuiltinTask:
        """The task a demo base of a tiny catalog model is warm-started on: the builtin task being trained,
        or for JSONL data the echo task ``mod3`` (answer format: a short completion then EOS; reading
        digits from the prompt)."""
        return self.task if self.task is not None else builtin_task("mod3")


def load_prompts(data, seed: int) -> PromptSplit:
    """Train and held-out prompts from the profile's data section."""
    task = None
    if data.train.startswith("builtin:"):
        task = builtin_task(data.train.split(":", 1)[1])
        if task is None:
            raise UserError(f"data.train: unknown builtin task '{data.train}'",
                            fix=f"use one of {', '.join('builtin:' + n for n in BUILTIN_TASKS)} or a JSONL file")
        everything = task.items()
        train = [it for it in everything if not task.is_eval(it)]
        held_out = [it for it in everything if task.is_eval(it)]
    else:
        train = read_jsonl(data.train)
        held_out = []
    if data.eval:
        held_out = read_jsonl(data.eval) if not data.eval.startswith("builtin:") else held_out
    elif not held_out and data.eval_fraction > 0:
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
    return PromptSplit(train, held_out, task)


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
