"""Built-in synthetic tasks for the CPU demo: prompts, a verifiable reward, a format example.

A task that makes RL learning visible on a tiny model needs a reward with several valid
answers, and a warm start that teaches only the answer's *shape*: then the warm-started
policy is near chance and everything it gains afterwards comes from the reward.

``digit-sum``: the prompt ``417S07:`` asks for two digits that sum to 7 (``25``, ``61``...).
The three leading digits are an id the policy must learn to ignore; held-out prompts carry
ids never seen in training, so evaluation measures generalisation, not recall.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class PromptItem:
    """One prompt and what its reward needs: a reference answer or unit tests."""

    prompt: str
    answer: str | None = None
    tests: str | None = None
    entry_point: str | None = None
    source: str = ""
    """Where the item came from (file:line or builtin:NAME), for messages."""


@dataclass(frozen=True)
class BuiltinTask:
    name: str
    description: str
    items: Callable[[], list[PromptItem]]
    """Every prompt of the task, in a fixed order."""
    is_eval: Callable[[PromptItem], bool]
    """The task's own held-out split."""
    score: Callable[[str, PromptItem], float]
    """Reward of one completion (text after the prompt, special tokens removed)."""
    format_example: Callable[[PromptItem, random.Random], str]
    """A completion with the right shape and an arbitrary (usually wrong) content, for the warm start."""
    max_new_tokens: int = 4
    """Completion length the task needs, EOS included."""
    meta: dict = field(default_factory=dict)


_DIGIT_PAIR = re.compile(r"^\s*(\d)(\d)\s*$")


def _digit_sum_items() -> list[PromptItem]:
    return [PromptItem(prompt=f"{ident:03d}S{target:02d}:", answer=str(target), source="builtin:digit-sum")
            for ident in range(1000) for target in range(19)]


def _digit_sum_is_eval(item: PromptItem) -> bool:
    # ids ending in 7 are never trained on: one prompt in ten is held out
    return item.prompt[2] == "7"


def _digit_sum_score(completion: str, item: PromptItem) -> float:
    match = _DIGIT_PAIR.match(completion)
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) + int(match.group(2)) == int(item.answer or -1) else 0.0


def _digit_sum_format(item: PromptItem, rng: random.Random) -> str:
    return f"{rng.randrange(10)}{rng.randrange(10)}"


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "digit-sum": BuiltinTask(
        name="digit-sum",
        description="two digits that sum to the target: '417S07:' -> '25'; 19,000 prompts, ids ending in 7 held out",
        items=_digit_sum_items, is_eval=_digit_sum_is_eval, score=_digit_sum_score,
        format_example=_digit_sum_format, max_new_tokens=3,
    ),
}


def builtin_task(name: str) -> BuiltinTask | None:
    return BUILTIN_TASKS.get(name.strip().lower())
