"""Reward functions: ``builtin`` (the task's own), ``math``, ``code`` and ``python:module:function``.

A reward maps (completions, items) to one float per completion. ``math`` extracts the final
answer (``#### N``, else ``\\boxed{...}``, else the last number) and compares numerically.
``code`` runs prompt + completion and the item's tests in :mod:`orbitctl.rl.sandbox`; the
reward is the fraction of asserts passed. A user reward ``python:pkg.mod:fn`` is called once
per completion with the keyword arguments its signature names among ``prompt``,
``completion``, ``answer``, ``tests`` and ``item``, and returns a number.
"""

from __future__ import annotations

import importlib
import inspect
import re
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Callable

from orbitctl.errors import UserError
from orbitctl.data.tasks import BuiltinTask, PromptItem

RewardFn = Callable[[list[str], list[PromptItem]], list[float]]

_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The answer a math completion commits to: '#### N', else \\boxed{...}, else the last number."""
    match = _HASHES.findall(text)
    if match:
        return match[-1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Fraction | None:
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    cleaned = re.sub(r"\\frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", cleaned)
    found = _NUMBER.findall(cleaned)
    if not found:
        return None
    try:
        return Fraction(found[0].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(completion: str, answer: str | None) -> float:
    """1.0 when the completion's final answer equals the reference numerically (0.5 == 1/2 == 0.50)."""
    got, want = parse_number(extract_final_answer(completion)), parse_number(extract_final_answer(answer or "") or answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want))) else 0.0


def _code_reward(completions: list[str], items: list[PromptItem]) -> list[float]:
    from orbitctl.rl.sandbox import run_tests

    def one(pair):
        completion, item = pair
        if not item.tests:
            raise UserError(f"{item.source}: the code reward needs a 'tests' field",
                            fix="add tests to every line or use data.reward: math")
        return run_tests(item.prompt + completion, item.tests, item.entry_point).fraction

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(one, zip(completions, items)))


def _user_reward(spec: str) -> RewardFn:
    target = spec[len("python:"):]
    module_name, _, func_name = target.rpartition(":")
    if not module_name or not func_name:
        raise UserError(f"data.reward: '{spec}' is not python:module:function", fix="e.g. data.reward: python:my_rewards:score")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"data.reward: cannot import module '{module_name}' ({exc})",
                        fix="put the module on PYTHONPATH or in the current directory") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f"data.reward: module '{module_name}' has no function '{func_name}'")
    params = inspect.signature(func).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    known = ("prompt", "completion", "answer", "tests", "item")
    named = [k for k in known if takes_kwargs or k in params]
    positional = not any(k in params for k in known) and not takes_kwargs

    def call(completions: list[str], items: list[PromptItem]) -> list[float]:
        rewards = []
        for completion, item in zip(completions, items):
            values = {"prompt": item.prompt, "completion": completion, "answer": item.answer,
                      "tests": item.tests, "item": item}
            out = func(item.prompt, completion, item.answer) if positional else func(**{k: values[k] for k in named})
            try:
                rewards.append(float(out))
            except (TypeError, ValueError):
                raise UserError(f"data.reward: {spec} returned {type(out).__name__}, not a number") from None
        return rewards

    return call


def make_reward(spec: str, task: BuiltinTask | None) -> RewardFn:
    """The reward function a profile's ``data.reward`` names."""
    if spec == "builtin":
        if task is None:
            raise UserError("data.reward: 'builtin' needs data.train: builtin:NAME",
                            fix="use data.reward: math, code or python:module:function for JSONL data")
        return lambda completions, items: [task.score(c, it) for c, it in zip(completions, items)]
    if spec == "math":
        return lambda completions, items: [math_reward(c, it.answer) for c, it in zip(completions, items)]
    if spec == "code":
        return _code_reward
    if spec.startswith("python:"):
        return _user_reward(spec)
    raise UserError(f"data.reward: unknown reward '{spec}'", fix="use builtin, math, code or python:module:function")


