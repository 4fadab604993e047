"""How every orbitctl command shows its usage and help: each module registers its command with this class.

    app.command("plan", cls=Command)(plan)
    typer.Typer(cls=Group)          (a group of commands: orbitctl itself, orbitctl profile)

- The usage line names an argument the way click does, one way in every command: ``PROFILE`` when it is
  required, ``[PROFILE]`` when it may be left out, ``RUN_DIR...`` when it repeats (typer 0.29 writes
  ``{PROFILE}``, and ``[[PROFILE]]`` for an optional argument whose metavar carries its own brackets).
- A flag shows no value metavar: typer 0.29 shows ``<bool>`` beside ``--json``, which reads as if ``--json true``
  were how to write it (that is an error: a flag takes no value).
- The examples (the docstring's lines after ``Examples:``) come last, one per line and never wrapped at any
  terminal width, so each can be copied into a shell as it stands. They are written into click's help buffer
  as they are, after whatever typer's rich help printed. The prose above them flows at the terminal's width.
"""

from __future__ import annotations

from typing import Any

import typer.core

EXAMPLES_HEADING = "Examples:"


def split_examples(help_text: str | None) -> tuple[str | None, list[str]]:
    """A docstring's prose, each paragraph as one line for the terminal to wrap (rich markup keeps a docstring's
    line breaks), and the example lines after its ``Examples:`` line (each stripped, blank lines out)."""
    if not help_text:
        return help_text, []
    lines = help_text.splitlines()
    heading = next((i for i, line in enumerate(lines) if line.strip() == EXAMPLES_HEADING), len(lines))
    paragraphs = "\n".join(lines[:heading]).strip().split("\n\n")
    prose = "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines()) for paragraph in paragraphs)
    return prose, [line.strip() for line in lines[heading + 1:] if line.strip()]


def usage_name(param: Any) -> str:
    """An argument as the usage line names it: ``NAME``, ``[NAME]`` when optional, ``NAME...`` when repeated."""
    name = param.metavar or param.name.upper()
    if param.nargs != 1:
        name += "..."
    return name if param.required else f"[{name}]"


def _no_value_metavar(param: Any) -> Any:
    """A flag (``--json``, ``--machine/--no-machine``) shown without a value metavar."""
    if getattr(param, "is_flag", False) and param.metavar is None:
        param.metavar = ""
    return param


class _FlagsShowNoValue:
    """Mixed into a typer command or group: its flags show no value metavar, ``--help`` and the completion flags
    typer appends to a group after building it among them (hence at ``get_params``, which help and usage read)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return [_no_value_metavar(param) for param in super().get_params(ctx)]


class Group(_FlagsShowNoValue, typer.core.TyperGroup):
    """A typer group (``orbitctl``, ``orbitctl profile``) whose flags read as the module docstring says."""


class Command(_FlagsShowNoValue, typer.core.TyperCommand):
    """A typer command whose usage, flags and examples read as the module docstring says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help, self.examples = split_examples(self.help)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                pieces.append(usage_name(param))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces

    def format_help(self, ctx: Any, formatter: Any) -> None:
        super().format_help(ctx, formatter)
        if self.examples:
            formatter.write(f"\n {EXAMPLES_HEADING}\n\n" + "".join(f"   {line}\n" for line in self.examples))
