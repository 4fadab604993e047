"""data.system_prompt: a system turn before every prompt under the chat template, unless the prompt has its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orbitctl.model.policy import Policy


def _turns(system_prompt, prompt):
    return Policy.turns(SimpleNamespace(system_prompt=system_prompt), prompt)


def test_a_plain_prompt_gets_the_system_turn_first():
    assert _turns("Be brief.", "What is 2 + 2?") == [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "What is 2 + 2?"}]
    assert _turns(None, "What is 2 + 2?") == [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_chat_records_own_system_turn_wins():
    own = SimpleNamespace(messages=(("system", "You are terse."), ("user", "Hi")))
    assert _turns("Be brief.", own) == [{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "Hi"}]
    user_only = SimpleNamespace(messages=(("user", "Hi"),))
    assert _turns("Be brief.", user_only)[0] == {"role": "system", "content": "Be brief."}


def test_without_the_chat_template_it_is_refused(tmp_path, write_demo_profile, one_error_line, capsys):
    from orbitctl.cli.app import main

    path = write_demo_profile(tmp_path / "p.yaml", {"data.system_prompt": "Be brief."})
    assert main(["plan", str(path)]) == 2
    one_error_line(capsys.readouterr().err, "data.system_prompt", "chat_template")
