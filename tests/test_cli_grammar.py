"""One grammar for every command: the profile is one positional argument named PROFILE, flags take no value, the
help's examples stay one copy-pasteable line each at 80 columns, and `--fresh` is the one word for starting over."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from orbitctl.cli.app import app, main
from orbitctl.cli.command import split_examples

runner = CliRunner()


def _commands(group=None, path=()) -> dict[tuple[str, ...], object]:
    """Every command and group of the CLI by its words (() is orbitctl itself), each built as it runs."""
    group = group or typer.main.get_command(app)
    found = {path: group}
    for name in getattr(group, "commands", {}):
        command = group.commands[name]
        found.update(_commands(command, (*path, name)) if hasattr(command, "commands") else {(*path, name): command})
    return found


COMMANDS = _commands()
TAKES_A_PROFILE = {("plan",), ("quantize",), ("train",), ("verify-alignment",), ("doctor",), ("eval",), ("serve",),
                   ("export",), ("profile", "validate"), ("profile", "show")}


def _help(words: tuple[str, ...]) -> str:
    result = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _usage(words: tuple[str, ...]) -> str:
    line = next(line for line in _help(words).splitlines() if "Usage:" in line)
    return line.split("Usage:", 1)[1].strip()


def test_every_command_is_listed():
    leaves = {words for words, command in COMMANDS.items() if not hasattr(command, "commands")}
    assert TAKES_A_PROFILE <= leaves and ("report",) in leaves and ("profile", "init") in leaves


@pytest.mark.parametrize("words", sorted(TAKES_A_PROFILE), ids=" ".join)
def test_the_profile_is_one_positional_argument_named_PROFILE(words):
    usage = _usage(words)
    arguments = usage.split("[OPTIONS]", 1)[1].split()
    assert arguments[0] in ("PROFILE", "[PROFILE]", "PROFILE...", "[PROFILE"), usage  # [PROFILE | SRC] for quantize
    command = COMMANDS[words]
    profile = [p for p in command.params if p.param_type_name == "argument"][0]
    assert profile.metavar == "PROFILE" or profile.metavar.startswith("PROFILE |"), words
    assert not any("--profile" in p.opts for p in command.params), words


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=lambda w: " ".join(w) or "orbitctl")
def test_usage_names_arguments_one_way(words):
    usage = _usage(words)
    assert "{" not in usage and "[[" not in usage, usage
    for token in re.findall(r"[A-Za-z_]+", usage.split("[OPTIONS]", 1)[1]):
        assert token.isupper() or token in ("orbitctl",), (usage, token)


@pytest.mark.parametrize("words", sorted(COMMANDS), ids=lambda w: " ".join(w) or "orbitctl")
def test_flags_show_no_value_metavar(words):
    text = _help(words)
    assert "<bool>" not in text, words
    assert re.search(r"--help\s+Show this message", text), words


@pytest.mark.parametrize("words", sorted(w for w, c in COMMANDS.items() if getattr(c, "examples", None)),
                         ids=" ".join)
def test_help_examples_are_one_unwrapped_line_each_at_80_columns(words):
    lines = [line.strip() for line in _help(words).splitlines()]
    _, examples = split_examples(COMMANDS[words].callback.__doc__)
    assert len(examples) >= 2, words
    for example in examples:
        assert example in lines, example  # the whole command on one line of the help, as the docstring has it


def test_every_command_has_examples_and_some_are_wider_than_80_columns():
    """The check above would pass vacuously if no example were long enough to wrap."""
    leaves = {w: c for w, c in COMMANDS.items() if not hasattr(c, "commands")}
    assert all(len(getattr(c, "examples", [])) >= 2 for c in leaves.values()), \
        [w for w, c in leaves.items() if len(getattr(c, "examples", [])) < 2]
    assert max(len(e) for c in leaves.values() for e in c.examples) > 80


def test_start_over_is_fresh_everywhere():
    shown = {words: _help(words) for words in COMMANDS}
    assert "--fresh" in shown[("train",)] and "--fresh" in shown[("export",)]
    assert not [words for words, text in shown.items() if "--force" in text]


def test_exports_old_force_still_replaces_with_a_warning(monkeypatch, capsys):
    import orbitctl.export.api as export_api

    seen = {}

    class Done:
        def to_dict(self):
            return {}

    monkeypatch.setattr(export_api, "export", lambda *a, **kw: seen.update(kw) or Done())
    assert main(["export", "profiles/tiny-cpu.yaml", "out/x", "--format", "gguf", "--force", "--json"]) == 0
    assert seen["fresh"] is True and "--fresh" in capsys.readouterr().err
    assert main(["export", "profiles/tiny-cpu.yaml", "out/x", "--format", "gguf", "--fresh", "--json"]) == 0
    assert seen["fresh"] is True and capsys.readouterr().err == ""
