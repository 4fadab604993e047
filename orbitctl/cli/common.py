"""Options shared by several commands (one definition, many commands)."""

from __future__ import annotations

from typing import List, Optional

import typer

SetOption = typer.Option(
    None, "--set", "-s", metavar="KEY.PATH=VALUE",
    help="Override a profile value, e.g. --set memory.micro_batch_size=4 (repeatable).",
)
JsonOption = typer.Option(False, "--json", help="Print one JSON document on stdout instead of tables.")


def overrides(values: Optional[List[str]]) -> list[str]:
    return list(values or [])
