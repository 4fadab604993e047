"""Shared fixtures: one model cache per session, and a small copy of the demo profile."""

import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "profiles" / "tiny-cpu.yaml"


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """The demo base is built and quantized once into this directory (subprocesses inherit it)."""
    cache = os.environ.get("ORBITCTL_TEST_CACHE") or str(tmp_path_factory.mktemp("orbitctl-cache"))
    os.environ["ORBITCTL_CACHE"] = cache
    return cache


@pytest.fixture
def align_profile(tmp_path):
    """``align_profile(**overrides)``: the demo profile with its run dir under tmp_path, written and loaded."""
    from orbitctl.profile import load_profile

    def make(**overrides):
        data = yaml.safe_load(DEMO.read_text())
        for key, value in {"run.dir": str(tmp_path / "run"), "alignment.num_prompts": 24, **overrides}.items():
            node = data
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        path = tmp_path / "profile.yaml"
        path.write_text(yaml.safe_dump(data))
        return path, load_profile(path)

    return make
