"""`orbitctl profile validate|show|init`: check profiles, print the resolved values, write one for a model.

    orbitctl profile validate profiles/*.yaml
    orbitctl profile show profiles/tiny-cpu.yaml --json
    orbitctl profile show profiles/kimi-k2_grpo_int4_8xb200.yaml --set memory.micro_batch_size=4
    orbitctl profile init /models/Qwen2.5-7B-Instruct --gpu h100 --gpus 8 --data data/gsm8k.jsonl --out qwen7b.yaml
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command, Group
from orbitctl.cli.common import JsonOption, SetOption, overrides

app = typer.Typer(help="Validate profiles, show them resolved (defaults and derived values), or write one for a model.",
                  no_args_is_help=True, cls=Group)


@app.command("validate", cls=Command)
def validate(
    paths: List[str] = typer.Argument(..., metavar="PROFILE", help="Profile YAML files."),
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


@app.command("show", cls=Command)
def show(
    path: str = typer.Argument(..., metavar="PROFILE", help="Profile YAML file."),
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


@app.command("init", cls=Command)
def init(
    model: str = typer.Argument(..., metavar="MODEL",
                                help="A Hugging Face checkpoint directory, its config.json, or a GGUF file (local)."),
    gpu: str = typer.Option(..., "--gpu", metavar="NAME", help="The GPU from the catalog, e.g. h100, h200, a100-80g, l4."),
    gpus: int = typer.Option(..., "--gpus", min=1, max=16, metavar="N", help="GPUs per node."),
    out: str = typer.Option(..., "--out", metavar="FILE", help="The profile to write (an existing file is refused)."),
    nodes: int = typer.Option(1, "--nodes", min=1, metavar="N", help="Nodes."),
    data: Optional[str] = typer.Option(None, "--data", metavar="FILE", help="The training prompts (data.train)."),
    name: Optional[str] = typer.Option(None, "--name", metavar="NAME",
                                       help="The profile's name (default: model_grpo_quant_hardware)."),
    json_out: bool = JsonOption,
) -> None:
    """Write a commented profile for MODEL that `orbitctl plan` says fits: quant format, layout, micro-batch,
    rollout batch and adapter rank chosen by the plan, each with its reason beside it.

    Examples:

        orbitctl profile init /models/Qwen2.5-7B-Instruct --gpu h100 --gpus 8 --out qwen7b.yaml

        orbitctl profile init model.gguf --gpu l4 --gpus 1 --data train.jsonl --out small.yaml
    """
    from orbitctl.plan.profile_init import init_profile

    done = init_profile(model, gpu=gpu, gpus=gpus, out=out, nodes=nodes, data=data, name=name)
    if json_out:
        output.emit_json(done.to_dict())
        return
    table = output.table(f"{done.path}: {done.verdict}", ("key", "value", "why"), left=("key", "value", "why"))
    for key, (value, why) in done.choices.items():
        table.add_row(key, str(value), why)
    output.show(table)


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="profile")
