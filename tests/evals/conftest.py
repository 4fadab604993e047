"""Fixtures of the eval tests: a copy of the demo profile, and its base built before any command runs."""

from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml"


@pytest.fixture
def profile_yaml(tmp_path, write_demo_profile):
    """``profile_yaml(**dotted_overrides)``: the demo profile with a run dir under tmp_path; returns its path."""
    return lambda **overrides: write_demo_profile(tmp_path / "profile.yaml", {"run.dir": str(tmp_path / "run"),
                                                                           **overrides})


@pytest.fixture(scope="session")
def demo_base(model_cache):
    """The demo profile's quantized base, built into the session cache before any command runs (building
    it imports deepspeed, which logs a line to stdout on first import; a --json test reads stdout)."""
    from orbitctl.builder import prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(DEMO)
    return prepare_frozen_base(profile, load_prompts(profile.data, profile.run.seed).warm_task)


@pytest.fixture
def eval_json():
    """``eval_json(*args)``: ``orbitctl eval ARGS --json`` through the CLI, checked to exit 0; its JSON document."""
    import json

    from typer.testing import CliRunner

    from orbitctl.cli.app import app

    def run(*args: str) -> dict:
        result = CliRunner().invoke(app, ["eval", *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    return run
