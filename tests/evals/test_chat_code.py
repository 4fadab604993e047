"""HumanEval under a chat template: the reply of an instruct model is a chat answer, and its code is what is graded.

Graded here by the real sandbox against HumanEval/0's own tests, with the reference solution written as an
instruct model writes it (a fenced block with the whole function), as a bare body, and wrong."""

from __future__ import annotations

import pytest

from orbitctl.evals.runner import HUMANEVAL_STOP, chat_completion, truncate


@pytest.fixture(scope="module")
def first_task():
    from orbitctl.evals.suites import load_suite

    suite = load_suite("humaneval")
    return suite, suite.items[0]


SOLUTION = ("    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
            "            if i != j and abs(a - b) < threshold:\n                return True\n    return False\n")


def _whole_function(item, body: str) -> str:
    signature = next(line for line in item.prompt.splitlines() if line.startswith(f"def {item.entry_point}"))
    return f"from typing import List\n\n{signature}\n{body}"


def test_a_fenced_whole_function_replaces_the_prompts_and_passes(first_task):
    suite, item = first_task
    reply = f"Here is the function:\n\n```python\n{_whole_function(item, SOLUTION)}```\n\nIt compares every pair."
    completion = chat_completion(reply, item.entry_point)
    assert completion.startswith("\nfrom typing import List") and "It compares" not in completion
    assert [v.passed for v in suite.grade([completion], [item])] == [True]
    # the plain path cuts the same reply at its first top-level line: nothing of the function is left
    assert [v.passed for v in suite.grade([truncate(reply, HUMANEVAL_STOP)], [item])] == [False]


def test_a_bare_body_is_cut_at_the_stop_sequences_and_a_wrong_function_fails(first_task):
    suite, item = first_task
    body = chat_completion(SOLUTION + "\n\nprint('done')\n", item.entry_point)
    assert body == SOLUTION + "\n"
    assert [v.passed for v in suite.grade([body], [item])] == [True]
    wrong_function = _whole_function(item, "    return False\n")
    wrong = chat_completion(f"```\n{wrong_function}```", item.entry_point)
    assert [v.passed for v in suite.grade([wrong], [item])] == [False]
    unclosed = chat_completion(f"```python\n{_whole_function(item, SOLUTION)}", item.entry_point)  # cut by max tokens
    assert [v.passed for v in suite.grade([unclosed], [item])] == [True]
