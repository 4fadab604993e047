"""Built-in synthetic tasks for the CPU demo: prompts, a verifiable reward, warm-start examples.

A task that makes RL learning visible on a tiny model needs a reward with several valid
answers and a warm start that never shows the task's answers. Every prompt starts with a
two-symbol id; prompts whose id ends in ``?`` are held out, so evaluation measures
generalisation to unseen prompts, not recall.

``mod3`` (the demo): ``+-M5:`` asks for one digit d with 5 + d divisible by 3 (1, 4 or 7).
Its warm start is an *echo* task under another marker (``+-R5:`` -> ``5``): it teaches the
answer format (one digit, then EOS) and reading the prompt's digit, but no mod-3 answer.
The warm-started policy therefore echoes the target, which is right only when the target
is divisible by 3 (about 40% of prompts); everything beyond that comes from the reward.

``digit-sum``: ``+-S07:`` asks for two digits that sum to 7 (``25``, ``61``...), with a
format-only warm start (random digit pairs). Harder: see docs/train.md for what it needs.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable


class ChatPrompt(str):
    """The prompt of a chat record: its plain-text rendering, carrying the turns it was made from.

    A ``str``, so everything that concatenates, logs or tokenizes prompts takes it as it is; the
    policy reads :attr:`messages` when ``data.chat_template`` asks for the tokenizer's template.
    """

    messages: tuple[tuple[str, str], ...]
    """The (role, content) turns, up to and including the last user turn."""

    def __new__(cls, messages: list[tuple[str, str]]) -> "ChatPrompt":
        text = "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"
        prompt = super().__new__(cls, text)
        prompt.messages = tuple(messages)
        return prompt

    def __reduce__(self):
        return ChatPrompt, (list(self.messages),)


@dataclass(frozen=True)
class PromptItem:
    """One prompt and what its reward needs: a reference answer or unit tests."""

    prompt: str
    answer: str | None = None
    tests: str | None = None
    entry_point: str | None = None
    source: str = ""
    """Where the item came from (file:line or builtin:NAME), for messages."""
    task_id: str | None = None
    """The dataset's own id of the item (HumanEval's ``task_id``), when it has one."""


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
    reading_example: Callable[[random.Random], tuple[str, str]] | None = None
    """An auxiliary (prompt, completion) pair for the warm start that teaches reading the prompt
    (e.g. echoing a digit under another marker) without showing any answer of the task itself."""
    reading_share: float = 0.5
    """Share of warm-start examples drawn from ``reading_example`` (the rest are format examples)."""
    max_new_tokens: int = 4
    """Completion length the task needs, EOS included."""
    meta: dict = field(default_factory=dict)


ID_SYMBOLS = "+-*=#?,.()"
"""Prompt ids are two of these symbols: no digits, so the only digits a prompt holds are the target's."""


def _symbol_ids() -> list[str]:
    return [a + b for a in ID_SYMBOLS for b in ID_SYMBOLS]


_DIGIT_PAIR = re.compile(r"^\s*(\d)(\d)\s*$")


def _digit_sum_items() -> list[PromptItem]:
    return [PromptItem(prompt=f"{ident}S{target:02d}:", answer=str(target), source="builtin:digit-sum")
            for ident in _symbol_ids() for target in range(19)]


def _held_out(item: PromptItem) -> bool:
    # ids whose second symbol is '?' are never trained on: one prompt in ten is held out
    return item.prompt[1] == "?"


def _digit_sum_score(completion: str, item: PromptItem) -> float:
    match = _DIGIT_PAIR.match(completion)
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) + int(match.group(2)) == int(item.answer or -1) else 0.0


def _digit_sum_format(item: PromptItem, rng: random.Random) -> str:
    return f"{rng.randrange(10)}{rng.randrange(10)}"


_ONE_DIGIT = re.compile(r"^\s*(\d)\s*$")


def _mod3_items() -> list[PromptItem]:
    return [PromptItem(prompt=f"{ident}M{target}:", answer=str(target), source="builtin:mod3")
            for ident in _symbol_ids() for target in range(10)]


def _echo_example(rng: random.Random) -> tuple[str, str]:
    digit = str(rng.randrange(10))
    ids = _symbol_ids()
    return f"{ids[rng.randrange(len(ids))]}R{digit}:", digit


def _mod3_score(completion: str, item: PromptItem) -> float:
    match = _ONE_DIGIT.match(completion)
    if match is None:
        return 0.0
    return 1.0 if (int(match.group(1)) + int(item.answer or 0)) % 3 == 0 else 0.0


ARITH_OPERATIONS = (("+", range(2, 30), range(2, 30)), ("-", range(10, 40), None), ("times", range(2, 10), range(2, 10)))
"""Sums of two numbers below 30, differences of a number below 40 and a smaller one, one-digit products."""

_FINAL_NUMBER = re.compile(r"(-?\d+)\s*\.?\s*$")


_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "times": lambda a, b: a * b}


def _questions(operations, source: str) -> list[PromptItem]:
    """'What is a op b?' for every (op, firsts, seconds) of ``operations`` (seconds None: 1 .. a - 1)."""
    return [PromptItem(prompt=f"What is {a} {op} {b}?", answer=str(_APPLY[op](a, b)), source=source)
            for op, firsts, seconds in operations for a in firsts
            for b in (seconds if seconds is not None else range(1, a))]


def _arith_items() -> list[PromptItem]:
    return _questions(ARITH_OPERATIONS, "builtin:arith")


def _arith_held_out(item: PromptItem) -> bool:
    # a fixed tenth of the questions, spread over every operation by a hash of the question
    return zlib.crc32(item.prompt.encode()) % 10 == 0


def _arith_score(completion: str, item: PromptItem) -> float:
    match = _FINAL_NUMBER.search(completion.strip())
    return 1.0 if match is not None and match.group(1) == item.answer else 0.0


FACT_OPERATIONS = (("+", range(0, 14), range(0, 14)), ("times", range(2, 13), range(2, 13)))
"""Addition facts to 13 + 13 and the times tables to 12 x 12: answers a small instruct model mostly knows, but gives
inside an explanation ("To find 8 times 11, we ...") more often than on its own."""


def _fact_items() -> list[PromptItem]:
    return _questions(FACT_OPERATIONS, "builtin:facts")


def _fact_held_out(item: PromptItem) -> bool:
    # half of the facts, by a hash of the question: the other half trains
    return zlib.crc32(item.prompt.encode()) % 2 == 0


_FOR_INSTRUCT_MODELS = {"for": "pretrained instruct models under their chat template"}

BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "mod3": BuiltinTask(
        name="mod3",
        description="one digit d with target + d divisible by 3: '+-M5:' -> '1', '4' or '7'; ids ending in '?' held out",
        items=_mod3_items, is_eval=_held_out, score=_mod3_score,
        format_example=lambda item, rng: str(rng.randrange(10)), max_new_tokens=2,
        reading_example=_echo_example, reading_share=1.0,
    ),
    "digit-sum": BuiltinTask(
        name="digit-sum",
        description="two digits that sum to the target: '+-S07:' -> '25'; ids ending in '?' held out",
        items=_digit_sum_items, is_eval=_held_out, score=_digit_sum_score,
        format_example=_digit_sum_format, max_new_tokens=3,
    ),
    "arith": BuiltinTask(
        name="arith",
        description="a short arithmetic question in words, 'What is 24 + 17?': the reward is 1 when the completion "
                    "ends with the right number ('24 + 17 = 41', '41'), 0 when it is cut short or says more after it; "
                    "a fixed tenth of the questions held out",
        items=_arith_items, is_eval=_arith_held_out, score=_arith_score,
        format_example=lambda item, rng: str(rng.randrange(100)), max_new_tokens=10,
        meta=_FOR_INSTRUCT_MODELS,
    ),
    "facts": BuiltinTask(
        name="facts",
        description="an addition or times-table fact, 'What is 8 times 11?' (sums to 13 + 13, products to 12 x 12): "
                    "the reward is 1 when the completion ends with the right number, as for arith; half of the "
                    "questions held out",
        items=_fact_items, is_eval=_fact_held_out, score=_arith_score,
        format_example=lambda item, rng: str(rng.randrange(150)), max_new_tokens=10,
        meta=_FOR_INSTRUCT_MODELS,
    ),
}


def builtin_task(name: str) -> BuiltinTask | None:
    return BUILTIN_TASKS.get(name.strip().lower())
