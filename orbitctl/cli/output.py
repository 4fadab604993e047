"""The only module that prints.

stdout carries data (tables, JSON); stderr carries messages, progress and warnings.
``--json`` output is exactly one document printed with ``print(json.dumps(...))``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

stdout = Console(soft_wrap=False)
stderr = Console(stderr=True, soft_wrap=False)


def emit_json(document: Any) -> None:
    """Print one JSON document on stdout (never through rich, which wraps lines)."""
    print(json.dumps(document, indent=2, sort_keys=False, default=_json_default))
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def show(renderable: Any) -> None:
    """Print a table or text on stdout."""
    stdout.print(renderable)


def info(message: str) -> None:
    """A message for the person at the terminal, on stderr."""
    stderr.print(message, highlight=False)


def warn(message: str) -> None:
    stderr.print(f"[yellow]Warning:[/yellow] {message}", highlight=False)


def error(message: str) -> None:
    """``Error: ...`` lines on stderr; markup is not interpreted so file paths print as given."""
    for i, line in enumerate(message.splitlines() or [""]):
        prefix = "Error: " if i == 0 else "       "
        stderr.print(prefix + line, markup=False, highlight=False, soft_wrap=True)


STATUS_STYLE = {"FAIL": "bold red", "WARN": "yellow", "UNKNOWN": "magenta", "INFO": "cyan", "PASS": "green",
                "SKIP": "dim", "OK": "bold green", "FAILED": "bold red"}
"""How a verdict word looks, the same in every command."""


def status(word: str, text: str | None = None):
    """A rich Text of ``text`` (default: the word itself) styled by the verdict ``word``."""
    from rich.text import Text

    return Text(word if text is None else text, style=STATUS_STYLE.get(word, ""))
