"""`orbitctl serve`: an OpenAI-compatible server over the profile's frozen base and its adapters.

    orbitctl serve profiles/tiny-cpu.yaml
    orbitctl serve profiles/tiny-cpu.yaml --adapter runs/tiny-cpu/adapter --port 8001
    orbitctl serve profiles/tiny-cpu.yaml --adapter step100=runs/tiny-cpu/checkpoints/step-100/adapter
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.common import SetOption, overrides


def serve_command(
    profile_path: str = typer.Argument(..., metavar="PROFILE", help="Profile YAML: its base, adapter layout and device."),
    adapter: Optional[List[str]] = typer.Option(None, "--adapter", metavar="[NAME=]DIR",
                                                help="Load a trained adapter at start, served as model NAME (default: "
                                                     "the directory's name); repeatable."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: loopback only)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to bind."),
    max_waiting: int = typer.Option(8, "--max-waiting", min=0,
                                    help="Requests that may wait for the one generation slot; more get HTTP 429."),
    set_: Optional[List[str]] = SetOption,
) -> None:
    """Serve /v1/completions, /v1/chat/completions and /v1/models over the trainer's infer path.

    The base is served under the profile's name; each adapter under its NAME (pass it as "model").
    More adapters load at run time with POST /v1/load_lora_adapter {"lora_name", "lora_path"}.

    Examples:

        orbitctl serve profiles/tiny-cpu.yaml

        orbitctl serve profiles/tiny-cpu.yaml --adapter runs/tiny-cpu/adapter --port 8001

        orbitctl serve profiles/tiny-cpu.yaml --adapter step100=runs/tiny-cpu/checkpoints/step-100/adapter
    """
    from orbitctl.serve import api

    api.serve_profile(profile_path, overrides(set_), adapter or [], host=host, port=port, max_waiting=max_waiting,
                      on_ready=output.info)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
