"""The only module that prints.

stdout carries data (tables, JSON); stderr carries messages, progress and warnings.
``--json`` output is exactly one document printed with ``print(json.dumps(...))``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

_CONSOLES: dict[str, Any] = {}


def console(stream: str):
    """The rich Console on ``stream`` ("stdout" or "stderr"), made at its first use: importing rich.console
    takes longer than a whole ``plan --json``, whose output never goes through rich."""
    if stream not in _CONSOLES:
        from rich.console import Console

        _CONSOLES[stream] = Console(stderr=stream == "stderr", soft_wrap=False)
    return _CONSOLES[stream]


def __getattr__(name: str) -> Any:
    """``output.stdout`` and ``output.stderr``: the two consoles, made when first read."""
    if name in ("stdout", "stderr"):
        return console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def emit_json(document: Any, *, one_line: bool = False) -> None:
    """Print one JSON document on stdout (never through rich, which wraps lines); ``one_line`` for a command that
    goes on running after it (``serve``), so that whoever reads its stdout line by line has the document whole."""
    print(json.dumps(document, indent=None if one_line else 2, sort_keys=False, default=_json_default))
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
    console("stdout").print(renderable)


def info(message: str) -> None:
    """A message for the person at the terminal, on stderr."""
    console("stderr").print(message, highlight=False)


def warn(message: str) -> None:
    console("stderr").print(f"[yellow]Warning:[/yellow] {message}", highlight=False)


def error(message: str) -> None:
    """``Error: ...`` lines on stderr; markup is not interpreted so file paths print as given."""
    for i, line in enumerate(message.splitlines() or [""]):
        prefix = "Error: " if i == 0 else "       "
        console("stderr").print(prefix + line, markup=False, highlight=False, soft_wrap=True)


STATUS_STYLE = {"FAIL": "bold red", "WARN": "yellow", "UNKNOWN": "magenta", "INFO": "cyan", "PASS": "green",
                "SKIP": "dim", "n/a": "dim", "OK": "bold green", "FAILED": "bold red"}
"""How a verdict word looks, the same in every command."""


def status(word: str, text: str | None = None):
    """A rich Text of ``text`` (default: the word itself) styled by the verdict ``word``."""
    from rich.text import Text

    return Text(word if text is None else text, style=STATUS_STYLE.get(word, ""))


class _Bar:
    """A rich progress bar on stderr, started at its first update (so errors raised before any work
    stay one line) and stopped when the block ends."""

    def __init__(self, description: str, columns: tuple) -> None:
        self.description, self.columns = description, columns
        self.bar = None
        self.task = None

    def update(self, done: int, total: int, description: str | None = None) -> None:
        if self.bar is None:
            from rich.progress import Progress

            self.bar = Progress("[progress.description]{task.description}", *self.columns, console=console("stderr"),
                                transient=True)
            self.bar.start()
            self.task = self.bar.add_task(description or self.description, total=total)
        self.bar.update(self.task, completed=done, total=total, description=description or self.description)

    def stage(self, stage: str, done: int, total: int) -> None:
        """``update`` for work that reports its stage name with every step."""
        self.update(done, total, stage)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class progress:
    """``with output.progress("quantizing", unit="bytes") as update: work(progress=update)``: a bar on stderr
    fed ``update(done, total)`` (``stages=True``: ``update(stage, done, total)``); ``update`` is None when
    not ``enabled`` (``--json``), so the work runs without one."""

    def __init__(self, description: str = "", *, unit: str = "items", stages: bool = False, enabled: bool = True):
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, TimeElapsedColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        columns = ((BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn()) if unit == "bytes"
                   else (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()))
        self.bar = _Bar(description, columns) if enabled else None
        self.stages = stages

    def __enter__(self):
        if self.bar is None:
            return None
        return self.bar.stage if self.stages else self.bar.update

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def table(title: str, columns: list[str] | tuple[str, ...], rows=(), *, left: tuple[str, ...] | None = None,
          caption: str | None = None, no_wrap: bool = False):
    """A rich table titled on the left: the ``left`` columns (default: the first) left-aligned, the others
    right-aligned; ``rows`` of cells (more can be added with ``add_row``)."""
    from rich.table import Table

    left = (columns[0],) if left is None else left
    out = Table(title=title, title_justify="left", caption=caption)
    for col in columns:
        out.add_column(col, justify="left" if col in left else "right", no_wrap=no_wrap, overflow="fold")
    for row in rows:
        out.add_row(*row)
    return out


class LiveLine:
    """One status line on stderr, redrawn in place (``update(text)``), started at the first update and
    removed by ``close``; messages printed meanwhile scroll above it."""

    def __init__(self) -> None:
        from rich.live import Live

        self.live = Live(console=console("stderr"), refresh_per_second=4, transient=True)
        self.started = False

    def update(self, text: str) -> None:
        if not self.started:
            self.live.start()
            self.started = True
        self.live.update(text)

    def close(self) -> None:
        if self.started:
            self.live.stop()
