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
from orbitctl.errors import ProfileError

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
    from orbitctl.profile import load_profile

    problems: list[str] = []
    results = []
    for path in paths:
        try:
            load_profile(path, overrides(set_))
            results.append({"path": path, "ok": True, "problems": []})
        except ProfileError as exc:
            problems.append(exc.render())
            results.append({"path": path, "ok": False, "problems": exc.problems})
    if json_out:
        output.emit_json(results)
    else:
        for r in results:
            if r["ok"]:
                output.info(f"[green]ok[/green]  {r['path']}")
    if problems:
        raise _many(problems)


def _many(rendered: list[str]) -> ProfileError:
    err = ProfileError("", [])
    err.message = "\n".join(rendered)
    return err


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
    from orbitctl.profile import load_profile

    profile = load_profile(path, overrides(set_))
    document = profile.model_dump(mode="json")
    document["derived"] = profile.derived()
    if json_out:
        output.emit_json(document)
    else:
        import yaml

        output.show(yaml.safe_dump(document, sort_keys=False).rstrip())
