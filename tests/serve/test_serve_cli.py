"""`orbitctl serve` stays thin: it parses flags and hands them to orbitctl.serve.api.serve_profile."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from orbitctl.cli import serve as serve_cli
from orbitctl.errors import UserError
from orbitctl.serve.api import parse_adapter_arg
from orbitctl.serve.security import Limits


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
                                         "--host", "::1", "--max-waiting", "3", "--set", "run.seed=4",
                                         "--api-key", "k1", "--allow-adapter-loading", "--adapter-root", "runs",
                                         "--max-prompt-tokens", "100", "--max-tokens", "20", "--max-n", "4",
                                         "--max-batch", "64"])
    assert result.exit_code == 0, result.output
    assert seen["args"] == ("profiles/tiny-cpu.yaml", ["run.seed=4"],
                            ["runs/x/adapter", "s1=runs/x/checkpoints/step-1/adapter"])
    assert {k: seen["kwargs"][k] for k in ("host", "port", "max_waiting", "api_key", "allow_adapter_loading",
                                           "adapter_root")} == {"host": "::1", "port": 8123, "max_waiting": 3,
                                                                "api_key": "k1", "allow_adapter_loading": True,
                                                                "adapter_root": "runs"}
    assert seen["kwargs"]["limits"] == Limits(max_prompt_tokens=100, max_tokens=20, max_n=4, max_batch=64)


def test_the_api_key_comes_from_the_environment_and_adapter_loading_is_off_by_default(monkeypatch):
    seen = {}
    monkeypatch.setattr("orbitctl.serve.api.serve_profile", lambda *a, **kw: seen.update(kwargs=kw))
    result = CliRunner().invoke(_app(), ["serve", "profiles/tiny-cpu.yaml"], env={"ORBITCTL_API_KEY": "from-env"})
    assert result.exit_code == 0, result.output
    assert seen["kwargs"]["api_key"] == "from-env" and seen["kwargs"]["allow_adapter_loading"] is False
    assert seen["kwargs"]["adapter_root"] is None and seen["kwargs"]["limits"] == Limits()


def test_serve_binds_loopback_by_default(monkeypatch):
    seen = {}
    monkeypatch.setattr("orbitctl.serve.api.serve_profile", lambda *a, **kw: seen.update(kwargs=kw))
    monkeypatch.delenv("ORBITCTL_API_KEY", raising=False)
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


STARTER = """
import os, subprocess, sys
env = {**os.environ, "ORBITCTL_SERVE_PARENT": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-c", "from orbitctl.serve.api import _exit_with_parent; _exit_with_parent(); "
                          "print('ready', flush=True); import time; time.sleep(120)"], stdout=subprocess.PIPE, text=True,
                         env=env)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
import time; time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_started_for_a_run_ends_with_the_process_that_started_it():
    import os
    import time

    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    try:
        server = int(starter.stdout.readline())
        os.kill(server, 0)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server outlived the process that started it")
    finally:
        if starter.poll() is None:
            starter.kill()
    # a server whose starter is already gone (here: a pid that is not its parent) does not start
    orphan = subprocess.run([sys.executable, "-c", "import os; os.environ['ORBITCTL_SERVE_PARENT'] = str(os.getpid()); "
                             "from orbitctl.serve.api import _exit_with_parent; _exit_with_parent()"],
                            capture_output=True, text=True)
    assert orphan.returncode != 0 and "has already exited" in orphan.stderr
