"""`orbitctl serve` stays thin: it parses flags and hands them to orbitctl.serve.api.serve_profile."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from orbitctl.cli import serve as serve_cli
from orbitctl.errors import UserError
from orbitctl.serve.api import parse_adapter_arg


def _app() -> typer.Typer:
    app = typer.Typer()
    serve_cli.register(app)

    @app.command("noop", hidden=True)
    def noop() -> None:  # a second command keeps "serve" a subcommand, as in the real app
        """Nothing."""

    return app


def test_serve_passes_every_flag_to_the_library(monkeypatch):
    seen = {}
    monkeypatch.setattr("orbitctl.serve.api.serve_profile", lambda *a, **kw: seen.update(args=a, kwargs=kw))
    result = CliRunner().invoke(_app(), ["serve", "profiles/tiny-cpu.yaml", "--adapter", "runs/x/adapter",
                                         "--adapter", "s1=runs/x/checkpoints/step-1/adapter", "--port", "8123",
                                         "--host", "::1", "--max-waiting", "3", "--set", "run.seed=4"])
    assert result.exit_code == 0, result.output
    assert seen["args"] == ("profiles/tiny-cpu.yaml", ["run.seed=4"],
                            ["runs/x/adapter", "s1=runs/x/checkpoints/step-1/adapter"])
    assert {k: seen["kwargs"][k] for k in ("host", "port", "max_waiting")} == {"host": "::1", "port": 8123,
                                                                             "max_waiting": 3}


def test_serve_binds_loopback_by_default(monkeypatch):
    seen = {}
    monkeypatch.setattr("orbitctl.serve.api.serve_profile", lambda *a, **kw: seen.update(kwargs=kw))
    assert CliRunner().invoke(_app(), ["serve", "profiles/tiny-cpu.yaml"]).exit_code == 0
    assert (seen["kwargs"]["host"], seen["kwargs"]["port"]) == ("127.0.0.1", 8000)


def test_adapter_names():
    assert parse_adapter_arg("runs/x/adapter") == ("adapter", "runs/x/adapter")
    assert parse_adapter_arg("best=runs/x/adapter") == ("best", "runs/x/adapter")
    with pytest.raises(UserError, match="NAME=DIR"):
        parse_adapter_arg("best=")


def test_command_module_imports_no_torch():
    code = "import sys, orbitctl.cli.serve, orbitctl.serve.api; print('torch' in sys.modules, 'fastapi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
