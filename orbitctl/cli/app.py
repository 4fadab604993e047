"""The `orbitctl` entry point: names the commands, builds the one that runs, maps errors to exit codes.

    orbitctl plan profiles/tiny-cpu.yaml
    orbitctl --help
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import typer
import typer.core

from orbitctl.cli.command import Group
from orbitctl.errors import EXIT_BAD_INPUT, OrbitError

COMMANDS: dict[str, str] = {
    "plan": "plan", "quantize": "quantize", "train": "train", "verify-alignment": "verify_alignment",
    "doctor": "doctor", "eval": "evaluate", "report": "report", "serve": "serve", "export": "export",
    "profile": "profile",
}
"""Every subcommand, in the order ``orbitctl --help`` lists them, and its module in ``orbitctl.cli``, whose
``register(app)`` adds it to a Typer app. Each command module owns one command; importing them pulls in no
torch. A module that is not there (a slimmed install) leaves its command out."""


class LazyCommands(MutableMapping):
    """A group's subcommands by name, each one built (its module imported, its parameters read by typer) when
    first looked up: ``orbitctl plan`` builds the plan command only, not the nine others it never runs, while
    the names (for "No such command", "Did you mean") are known without building anything; the help, which
    shows every command's summary, builds them all."""

    def __init__(self, names: list[str], build: Callable[[str], Any]) -> None:
        self._commands: dict[str, Any] = dict.fromkeys(names)
        """name -> its click command, None until built."""
        self._build = build

    def __getitem__(self, name: str) -> Any:
        command = self._commands[name]
        if command is None:
            command = self._commands[name] = self._build(name)
        return command

    def __setitem__(self, name: str, command: Any) -> None:
        self._commands[name] = command

    def __delitem__(self, name: str) -> None:
        del self._commands[name]

    def __contains__(self, name: object) -> bool:
        return name in self._commands

    def __iter__(self) -> Iterator[str]:
        return iter(self._commands)

    def __len__(self) -> int:
        return len(self._commands)


def _build_command(name: str) -> Any:
    """The click command ``name`` exactly as typer builds it for ``app``: the module registers it on a Typer
    made with ``app``'s settings, and typer turns that into a group holding it."""
    import importlib

    import typer.main

    module = importlib.import_module(f"orbitctl.cli.{COMMANDS[name]}")
    holder = typer.Typer(rich_markup_mode=app.rich_markup_mode, pretty_exceptions_short=app.pretty_exceptions_short,
                         suggest_commands=app.suggest_commands)
    module.register(holder)
    return typer.main.get_group(holder).commands[name]


def _available() -> list[str]:
    """The names of :data:`COMMANDS` whose module exists (found, not imported)."""
    import importlib.util

    return [name for name, module in COMMANDS.items() if importlib.util.find_spec(f"orbitctl.cli.{module}")]


class OrbitctlGroup(Group):
    """The top-level group, whose subcommands are :class:`LazyCommands`."""

    def __init__(self, *, commands: Any = None, **attrs: Any) -> None:
        lazy = LazyCommands(_available(), _build_command)
        lazy.update(commands or {})  # any registered on app itself, built by typer already
        super().__init__(commands=lazy, **attrs)


def _no_group_options() -> None:
    """Runs before every subcommand and does nothing: a callback is what makes typer build a group while no
    command is registered on the app itself (all are in :data:`COMMANDS`). The app's help text wins over this
    docstring."""


app = typer.Typer(
    name="orbitctl",
    help="Plan, quantize, train, verify and diagnose adapter-first RL post-training on one 8-GPU node.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=OrbitctlGroup,
    callback=_no_group_options,
)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every OrbitError becomes one `Error:` line and its exit code."""
    from orbitctl.cli import output

    debug = os.environ.get("ORBITCTL_DEBUG", "") not in ("", "0")
    try:
        app(args=argv, standalone_mode=False)
    except OrbitError as exc:
        if debug:
            raise
        output.error(exc.render())
        return exc.exit_code
    except KeyboardInterrupt:
        output.error("interrupted")
        return 130
    except Exception as exc:  # typer/click usage errors and anything unforeseen
        code = _usage_exit_code(exc)
        if code is not None:
            if code:
                _show_usage_error(exc)
            return code
        if debug:
            raise
        output.error(f"{type(exc).__name__}: {exc}. Rerun with ORBITCTL_DEBUG=1 for the traceback")
        return 1
    return 0


def _usage_exit_code(exc: Exception) -> int | None:
    """Click's usage errors and exits carry their own exit code; map them without importing click."""
    if type(exc).__name__ in ("Exit",):
        return getattr(exc, "exit_code", 0)
    if hasattr(exc, "exit_code") and hasattr(exc, "format_message"):
        return EXIT_BAD_INPUT if getattr(exc, "exit_code", 2) == 2 else exc.exit_code
    if type(exc).__name__ == "Abort":
        return 1
    return None


def _show_usage_error(exc: Exception) -> None:
    from orbitctl.cli import output

    if hasattr(exc, "show"):
        exc.show()
    else:
        output.error(str(exc))


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
