"""`orbitctl serve`: an OpenAI-compatible server over the profile's frozen base and its adapters.

    orbitctl serve profiles/tiny-cpu.yaml
    orbitctl serve profiles/tiny-cpu.yaml --adapter runs/tiny-cpu/adapter --port 8001
    orbitctl serve profiles/tiny-cpu.yaml --adapter step100=runs/tiny-cpu/checkpoints/step-100/adapter
    ORBITCTL_API_KEY=... orbitctl serve profiles/tiny-cpu.yaml --host 0.0.0.0 --allow-adapter-loading --adapter-root runs
    orbitctl serve profiles/tiny-cpu.yaml --port 0 --json     (one JSON line on stdout once the port is bound)
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
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
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ORBITCTL_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on every route but /health "
                                               "(prefer the environment variable: a flag shows in ps). Needed to "
                                               "bind beyond loopback."),
    allow_adapter_loading: bool = typer.Option(False, "--allow-adapter-loading",
                                               help="Let clients load and unload adapters at run time "
                                                    "(/v1/load_lora_adapter, /load_lora_adapter); needs --adapter-root."),
    adapter_root: Optional[str] = typer.Option(None, "--adapter-root", metavar="DIR",
                                               help="The only directory run-time adapter loads read from (paths "
                                                    "resolved, symlinks followed; '..' refused)."),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", min=1,
                                                    help="Longest prompt accepted (default: the base's context)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1,
                                             help="Most tokens one completion may ask for (default: what the context "
                                                  "leaves)."),
    max_n: int = typer.Option(16, "--max-n", min=1, help="Most completions of one prompt (n)."),
    max_batch: int = typer.Option(1024, "--max-batch", min=1, help="Most completions in one request (prompts x n)."),
    set_: Optional[List[str]] = SetOption,
    json_out: bool = typer.Option(False, "--json", help="Print the startup facts (url, port, pid, models, key "
                                                        "required, adapter loading, limits) as one JSON line on "
                                                        "stdout once the port listens."),
) -> None:
    """Serve /v1/completions, /v1/chat/completions and /v1/models over the trainer's infer path.

    The base is served under the profile's name; each adapter under its NAME (pass it as "model").
    With --allow-adapter-loading, more adapters load at run time from under --adapter-root with
    POST /v1/load_lora_adapter {"lora_name", "lora_path"}. Beyond loopback an API key is required.

    Examples:

        orbitctl serve profiles/tiny-cpu.yaml

        orbitctl serve profiles/tiny-cpu.yaml --adapter runs/tiny-cpu/adapter --port 8001

        orbitctl serve profiles/tiny-cpu.yaml --adapter step100=runs/tiny-cpu/checkpoints/step-100/adapter

        ORBITCTL_API_KEY=... orbitctl serve profiles/tiny-cpu.yaml --host 0.0.0.0 --allow-adapter-loading --adapter-root runs

        orbitctl serve profiles/tiny-cpu.yaml --port 0 --json
    """
    from orbitctl.serve import api
    from orbitctl.serve.security import Limits

    api.serve_profile(profile_path, overrides(set_), adapter or [], host=host, port=port, max_waiting=max_waiting,
                      api_key=api_key, allow_adapter_loading=allow_adapter_loading, adapter_root=adapter_root,
                      limits=Limits(max_prompt_tokens, max_tokens, max_n, max_batch),
                      on_ready=_emit_startup if json_out else _show_startup)


def _emit_startup(startup) -> None:
    output.emit_json(startup.to_dict(), one_line=True)


def _show_startup(startup) -> None:
    guarded = " (API key required)" if startup.api_key_required else ""
    output.info(f"serving {', '.join([startup.base, *startup.adapters])} at {startup.url}{guarded}")


def register(app: typer.Typer) -> None:
    app.command("serve", cls=Command)(serve_command)
