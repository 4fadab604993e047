"""Reward functions: ``builtin`` (the task's own), ``math``, ``code`` and ``python:module:function``.

A reward maps (completions, items) to one float per completion. ``math`` takes the completion's
final answer (its last ``\\boxed{...}``, else ``#### N``, else its last number) and the item's
reference (its last ``\\boxed{...}``, else ``#### N``, else the whole reference; a reference in
prose falls back to its last number), normalises both (:func:`normalize_answer`) and scores 1.0
when they are the same text or the same number (``0.5`` == ``1/2`` == ``\\frac{1}{2}``).
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
from orbitctl.data.formats import last_boxed
from orbitctl.data.tasks import BuiltinTask, PromptItem

RewardFn = Callable[[list[str], list[PromptItem]], list[float]]

_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PROSE = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")


def extract_final_answer(text: str) -> str | None:
    """The answer a math completion commits to: its last \\boxed{...}, else '#### N', else its last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    match = _HASHES.findall(text)
    if match:
        return match[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# (pattern, replacement) in order; see normalize_answer
_REWRITES = [
    (re.compile(r"\\\$|\$"), ""),                                   # $...$ and \$
    (re.compile(r"\\(?:left|right)(?![A-Za-z])"), ""),              # \left( \right)
    (re.compile(r"\\[!,;:> ]|\\q?quad(?![A-Za-z])|~"), " "),        # TeX spacing
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])"), ""),  # degrees
    (re.compile(r"\\?%"), ""),                                      # percent
    # a trailing \text{...} after a value is a unit: 5 \text{ cm}
    (re.compile(r"(?<=[\w}.)])\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}\s*$"), ""),
    (re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\s*\{([^{}]*)\}"), r"\1"),
    (re.compile(r"^(-?[\d,]*\.?\d+)\s+[A-Za-z]+(?:\s+[A-Za-z]+)*$"), r"\1"),  # 18 dollars
    (re.compile(r"\\[dt]frac(?![A-Za-z])"), r"\\frac"),
    (re.compile(r"\\frac\s*(\w)\s*(\w)"), r"\\frac{\1}{\2}"),       # \frac12
    (re.compile(r"\\frac\s*(\w)\s*\{"), r"\\frac{\1}{"),            # \frac1{2}
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*(\w)"), r"\\frac\1{\2}"),  # \frac{1}2
    (re.compile(r"\\sqrt\s*(\w)"), r"\\sqrt{\1}"),                  # \sqrt2
    (re.compile(r"^[A-Za-z]\s*=(?!=)"), ""),                        # x = 5
    (re.compile(r"\s+"), ""),
    (re.compile(r"(?<![\d}])\.(\d)"), r"0.\1"),                     # .5
]
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUM = r"-?(?:\d+(?:\.\d+)?|\.\d+)"
_PLAIN = re.compile(_NUM)
_RATIO = re.compile(rf"({_NUM})/({_NUM})")
_FRAC = re.compile(rf"(-?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}")


def normalize_answer(text: str) -> str:
    """A LaTeX answer in a form two ways of writing it share: no ``$``, ``\\left``/``\\right``, TeX spacing,
    ``^\\circ``, ``%`` or spaces; a trailing ``\\text{unit}`` (or plain words after a number) dropped and other
    ``\\text{...}`` unwrapped; ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``,
    ``\\sqrt2`` -> ``\\sqrt{2}``; a leading ``x =`` dropped; no trailing ``.``; ``.5`` -> ``0.5``; ``1,000`` -> ``1000``."""
    s = text.strip()
    for pattern, replacement in _REWRITES:
        s = pattern.sub(replacement, s)
    s = s.rstrip(".")
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def answer_value(normalized: str) -> Fraction | None:
    """The number a normalised answer is, when it is one whole: ``3``, ``-0.25``, ``3/4``, ``\\frac{3}{4}``."""
    try:
        if _PLAIN.fullmatch(normalized):
            return Fraction(normalized)
        ratio = _RATIO.fullmatch(normalized)
        if ratio:
            return Fraction(ratio.group(1)) / Fraction(ratio.group(2))
        frac = _FRAC.fullmatch(normalized)
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
    except ZeroDivisionError:
        return None
    return None


def answers_match(got: str, want: str) -> bool:
    """Same normalised text, or the same number (relative tolerance 1e-6)."""
    a, b = normalize_answer(got), normalize_answer(want)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = answer_value(a), answer_value(b)
    return x is not None and y is not None and abs(float(x) - float(y)) <= 1e-6 * max(1.0, abs(float(y)))


def _reference_answer(answer: str) -> str:
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    match = _HASHES.findall(answer)
    return match[-1] if match else answer


def math_reward(completion: str, answer: str | None) -> float:
    """1.0 when the completion's final answer matches the reference (see the module docstring)."""
    got = extract_final_answer(completion)
    if got is None or not answer:
        return 0.0
    want = _reference_answer(answer)
    if answers_match(got, want):
        return 1.0
    numbers = _NUMBER.findall(want) if _PROSE.search(want) else []
    return 1.0 if numbers and answers_match(got, numbers[-1]) else 0.0


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


