"""A small copy of the demo profile."""

import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "profiles" / "tiny-cpu.yaml"


def env_overrides() -> dict:
    """``ORBITCTL_TEST_SET="quant.compute_dtype=bf16,adapter.dtype=bf16"``: run these tests on another
    setting of the demo profile (e.g. bf16 compute on kernels capped to AVX2, where the floor is not 0)."""
    pairs = [item.split("=", 1) for item in os.environ.get("ORBITCTL_TEST_SET", "").split(",") if item.strip()]
    return {key.strip(): yaml.safe_load(value) for key, value in pairs}


@pytest.fixture
def align_profile(tmp_path):
    """``align_profile(**overrides)``: the demo profile with its run dir under tmp_path, written and loaded."""
    from orbitctl.profile import load_profile

    def make(**overrides):
        data = yaml.safe_load(DEMO.read_text())
        defaults = {"run.dir": str(tmp_path / "run"), "alignment.num_prompts": 24, **env_overrides()}
        for key, value in {**defaults, **overrides}.items():
            node = data
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        path = tmp_path / "profile.yaml"
        path.write_text(yaml.safe_dump(data))
        return path, load_profile(path)

    return make
