"""`orbitctl profile validate|show`: check profiles and print the resolved values.

    orbitctl profile validate profiles/*.yaml
    orbitctl profile show profiles/tiny-cpu.yaml --json
    orbitctl profile show profiles/kimi-k2_grpo_int4_8xb200.yaml --set memory.micro_batch_size=4
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.common import JsonOption, SetOption, overrides

app = typer.Typer(help="Validate profiles and show them resolved (defaults and derived values).", no_args_is_help=True)


@app.command("validate")
def validate(
    paths: List[str] = typer.Argument(..., help="Profile YAML files."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
) -> None:
    """Validate one or more profiles; every error in every file is reported at once.

    Examples:

        orbitctl profile validate profiles/*.yaml

        orbitctl profile validate my.yaml --set memory.seq_len=8192
    """
    from orbitctl.profile import api

    rows = api.validate_profiles(paths, overrides(set_))
    if json_out:
        output.emit_json([{k: r[k] for k in ("path", "ok", "problems")} for r in rows])
    else:
        for r in rows:
            if r["ok"]:
                output.info(f"[green]ok[/green]  {r['path']}")
    failed = api.failures(rows)
    if failed is not None:
        raise failed


@app.command("show")
def show(
    path: str = typer.Argument(..., help="Profile YAML file."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = JsonOption,
) -> None:
    """Print the resolved profile: every default filled in, plus derived values.

    Examples:

        orbitctl profile show profiles/tiny-cpu.yaml

        orbitctl profile show profiles/tiny-cpu.yaml --json
    """
    from orbitctl.profile import api

    document = api.resolved_profile(path, overrides(set_))
    if json_out:
        output.emit_json(document)
    else:
        import yaml

        output.show(yaml.safe_dump(document, sort_keys=False).rstrip())


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="profile")
