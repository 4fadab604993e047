"""Datasets in their own field layouts: prompt/answer/tests, GSM8K, MATH, HumanEval and chat messages.

:func:`read_items` reads any container :mod:`orbitctl.data.containers` knows and turns each record
into a :class:`~orbitctl.data.tasks.PromptItem`:

============  ==========================================  ==============================================
format        fields                                      prompt / reference
============  ==========================================  ==============================================
prompt        prompt + answer or tests (+ entry_point)    prompt / answer or tests
gsm8k         question + answer ending in ``#### N``      question / N (commas removed)
math          problem + solution with ``\\boxed{...}``     problem / the last boxed expression
humaneval     task_id + prompt + entry_point + test       prompt / tests = test, entry_point, task_id
messages      messages [+ answer or tests]                the turns up to the last user turn / answer,
                                                          else the last assistant turn after it
============  ==========================================  ==============================================

``fmt="auto"`` picks the format from the first record's keys (``messages``; ``prompt`` with
``test``: humaneval; ``prompt``; ``question``; ``problem``), and every record must then be one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orbitctl.data.containers import Record, read_records
from orbitctl.data.tasks import ChatPrompt, PromptItem
from orbitctl.errors import InputFileError, UserError

EXPECTED = {
    "prompt": "prompt + answer or tests (optional entry_point)",
    "gsm8k": "question + answer ending in '#### N'",
    "math": "problem + solution with a \\boxed{...} answer",
    "humaneval": "task_id + prompt + entry_point + test",
    "messages": "messages (a list of role/content turns) + answer or tests, or a final assistant turn",
}
"""The fields each format expects, as error messages name them."""


@dataclass
class DataFile:
    """The items of one data file and the format they were read in (the detected one for ``auto``)."""

    path: str
    format: str
    items: list[PromptItem]


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (nested braces kept), or
    of a brace-less ``\\boxed 5``; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox"):]
    body = rest.lstrip()
    if not body.startswith("{"):
        words = body.split(maxsplit=1) if rest.startswith(" ") else []
        return words[0].rstrip("$.") if words else None
    depth, j = 0, 0
    while j < len(body):
        if body[j] == "\\":  # skip the escaped character: \{ and \} neither open nor close
            j += 2
            continue
        if body[j] == "{":
            depth += 1
        elif body[j] == "}":
            depth -= 1
            if depth == 0:
                return body[1:j]
        j += 1
    return None


def _bad(record: Record, fmt: str, what: str) -> InputFileError:
    return InputFileError(f"{record.where}: {what}", fix=f"a {fmt} record needs {EXPECTED[fmt]}")


def _text(record: Record, fmt: str, key: str) -> str:
    value = record.fields.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(record, fmt, f"missing '{key}' (a non-empty string)")
    return value


def _optional_text(record: Record, fmt: str, key: str) -> str | None:
    value = record.fields.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(record, fmt, f"'{key}' must be a string")
    return value


def _prompt_item(record: Record) -> PromptItem:
    prompt = _text(record, "prompt", "prompt")
    answer, tests = record.fields.get("answer"), _optional_text(record, "prompt", "tests")
    if answer is None and tests is None:
        raise _bad(record, "prompt", "needs 'answer' (math/builtin rewards) or 'tests' (code reward)")
    return PromptItem(prompt=prompt, answer=None if answer is None else str(answer), tests=tests,
                      entry_point=_optional_text(record, "prompt", "entry_point"), source=record.where)


def _gsm8k_item(record: Record) -> PromptItem:
    question, solution = _text(record, "gsm8k", "question"), _text(record, "gsm8k", "answer")
    marker = solution.rfind("####")
    final = solution[marker + 4:].strip().split("\n")[0].replace(",", "").strip() if marker >= 0 else ""
    if not final:
        raise _bad(record, "gsm8k", "'answer' has no final '#### N' line")
    return PromptItem(prompt=question, answer=final, source=record.where)


def _math_item(record: Record) -> PromptItem:
    problem, solution = _text(record, "math", "problem"), _text(record, "math", "solution")
    boxed = last_boxed(solution)
    if boxed is None or not boxed.strip():
        raise _bad(record, "math", "'solution' has no \\boxed{...} answer")
    return PromptItem(prompt=problem, answer=boxed.strip(), source=record.where)


def _humaneval_item(record: Record) -> PromptItem:
    return PromptItem(prompt=_text(record, "humaneval", "prompt"), tests=_text(record, "humaneval", "test"),
                      entry_point=_text(record, "humaneval", "entry_point"), source=record.where,
                      task_id=_text(record, "humaneval", "task_id"))


def _messages_item(record: Record) -> PromptItem:
    turns = record.fields.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _bad(record, "messages", "missing 'messages' (a non-empty list of turns)")
    parsed = []
    for turn in turns:
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise _bad(record, "messages", "every turn needs 'role' and 'content' strings")
        parsed.append((turn["role"], turn["content"]))
    users = [i for i, (role, _) in enumerate(parsed) if role == "user"]
    if not users:
        raise _bad(record, "messages", "no user turn")
    answer, tests = record.fields.get("answer"), _optional_text(record, "messages", "tests")
    if answer is None and tests is None:
        replies = [content for role, content in parsed[users[-1] + 1:] if role == "assistant"]
        if not replies:
            raise _bad(record, "messages", "needs 'answer' or 'tests', or an assistant turn after the last user turn")
        answer = replies[-1]
    return PromptItem(prompt=ChatPrompt(parsed[:users[-1] + 1]), answer=None if answer is None else str(answer),
                      tests=tests, entry_point=_optional_text(record, "messages", "entry_point"), source=record.where)


FORMATS: dict[str, Callable[[Record], PromptItem]] = {
    "prompt": _prompt_item, "gsm8k": _gsm8k_item, "math": _math_item,
    "humaneval": _humaneval_item, "messages": _messages_item,
}
"""Format name -> the function that turns one record into an item (or raises naming the record)."""


def detect_format(fields: dict) -> str | None:
    """The format a record's keys say it is in, or None."""
    if "messages" in fields:
        return "messages"
    if "prompt" in fields:
        return "humaneval" if "test" in fields else "prompt"
    if "question" in fields:
        return "gsm8k"
    if "problem" in fields:
        return "math"
    return None


def read_items(path: str | Path, fmt: str = "auto") -> DataFile:
    """Every record of ``path`` as a :class:`PromptItem`, in ``fmt`` or, for ``auto``, the format of
    the first record; the first record that does not fit is an error naming it and the fields expected."""
    if fmt != "auto" and fmt not in FORMATS:
        raise UserError(f"data.format: unknown format '{fmt}'", fix=f"use auto or one of {', '.join(FORMATS)}")
    records = read_records(path)
    if not records:
        raise InputFileError(f"{path}: no records", fix="add one record per prompt")
    if fmt == "auto":
        fmt = detect_format(records[0].fields)
        if fmt is None:
            expected = "; ".join(f"{name}: {fields}" for name, fields in EXPECTED.items())
            raise InputFileError(f"{records[0].where}: fields {sorted(records[0].fields)} match no data format",
                                 fix=f"rename the fields or set data.format; expected {expected}")
    parse = FORMATS[fmt]
    return DataFile(str(path), fmt, [parse(record) for record in records])
