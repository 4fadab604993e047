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


class _BoundServer:
    """Stands in for uvicorn's server: holds the bound socket and returns at once instead of serving forever."""

    def __init__(self) -> None:
        self.sockets = []

    def run(self, sockets) -> None:
        self.sockets = sockets


def test_json_prints_the_startup_facts_once_the_port_is_bound(monkeypatch, tmp_path):
    """The real serve path (profile, refusals, bind, startup document) with the model and uvicorn left out."""
    import json

    from orbitctl.serve.engine import Engine

    servers = []

    def engine(profile, adapters, *, max_waiting):
        built = Engine(None, base_name=profile.name, adapter_kind="lora", context=64, max_waiting=max_waiting)
        built.adapters = {name: {"path": path} for name, path in adapters}
        return built

    def server(*args):
        servers.append(_BoundServer())
        return servers[-1]

    monkeypatch.setattr("orbitctl.serve.api.build_engine", engine)
    monkeypatch.setattr("orbitctl.serve.api._server", server)
    (tmp_path / "adapter").mkdir()
    result = CliRunner().invoke(_app(), ["serve", "profiles/tiny-cpu.yaml", "--port", "0", "--adapter",
                                         f"best={tmp_path / 'adapter'}", "--allow-adapter-loading", "--adapter-root",
                                         str(tmp_path), "--max-n", "4", "--json"], env={"ORBITCTL_API_KEY": "k1"})
    try:
        assert result.exit_code == 0, result.output
        assert len(result.stdout.splitlines()) == 1  # one line: a reader of the server's stdout has it whole
        doc = json.loads(result.stdout)
        port = servers[0].sockets[0].getsockname()[1]
        assert port > 0 and doc["port"] == port and doc["url"] == f"http://127.0.0.1:{port}/v1"
        assert (doc["host"], doc["base"], doc["adapters"]) == ("127.0.0.1", "tiny-cpu", ["best"])
        assert doc["api_key_required"] is True and "k1" not in result.stdout
        assert doc["adapter_loading"] is True and doc["adapter_root"] == str(tmp_path.resolve())
        assert doc["limits"] == {"max_prompt_tokens": None, "max_tokens": None, "max_n": 4, "max_batch": 1024}
        assert doc["pid"] > 0
    finally:
        for s in servers:
            for sock in s.sockets:
                sock.close()
    # without --json: one line for the person at the terminal, on stderr, and nothing on stdout
    monkeypatch.delenv("ORBITCTL_API_KEY", raising=False)
    result = CliRunner().invoke(_app(), ["serve", "profiles/tiny-cpu.yaml", "--port", "0"], env={"ORBITCTL_API_KEY": None})
    for s in servers[1:]:
        for sock in s.sockets:
            sock.close()
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and "serving tiny-cpu at http://127.0.0.1:" in result.stderr
