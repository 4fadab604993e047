"""The `orbitctl` entry point: registers the commands and maps errors to exit codes.

    orbitctl plan profiles/tiny-cpu.yaml
    orbitctl --help
"""

from __future__ import annotations

import os
import sys

import typer

from orbitctl.errors import EXIT_BAD_INPUT, OrbitError

app = typer.Typer(
    name="orbitctl",
    help="Plan, quantize, train, verify and diagnose adapter-first RL post-training on one 8-GPU node.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _register() -> None:
    # Each command module owns one command; importing them pulls in no torch.
    from orbitctl.cli import profile as profile_cmd

    app.add_typer(profile_cmd.app, name="profile")
    for module_name in ("plan", "quantize", "train", "verify_alignment", "doctor", "evaluate", "report", "serve", "export"):
        try:
            module = __import__(f"orbitctl.cli.{module_name}", fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name == f"orbitctl.cli.{module_name}":
                continue
            raise
        module.register(app)


_register()


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
