"""A small, fast version of the demo profile."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "profiles" / "tiny-cpu.yaml"

SMALL = {
    "rl.prompts_per_step": 8, "rl.group_size": 4, "memory.micro_batch_size": 16, "rollout.batch_size": 32,
    "rl.steps": 3, "rl.warmup_steps": 0, "run.eval_every": 100, "run.save_every": 100, "data.eval_size": 16,
}


def small_profile_yaml(tmp_path: Path, run_name: str, **overrides) -> Path:
    """A copy of the demo profile shrunk for tests, with dotted-key overrides; returns its path."""
    data = yaml.safe_load(DEMO.read_text())
    for key, value in {**SMALL, "run.dir": str(tmp_path / run_name), **overrides}.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def profile_yaml(tmp_path):
    """``profile_yaml(run_name, **overrides)``: a small demo profile written under tmp_path."""
    return lambda run_name="run", **overrides: small_profile_yaml(tmp_path, run_name, **overrides)


@pytest.fixture
def small_profile(tmp_path):
    from orbitctl.profile import load_profile

    def make(run_name="run", **overrides):
        return load_profile(small_profile_yaml(tmp_path, run_name, **overrides))

    return make


@pytest.fixture(scope="module")
def module_profile_yaml(tmp_path_factory):
    """``module_profile_yaml(run_name, **overrides)``: as ``profile_yaml``, for a run a module's tests share."""
    tmp = tmp_path_factory.mktemp("module-runs")
    return lambda run_name="run", **overrides: small_profile_yaml(tmp, run_name, **overrides)


@pytest.fixture(scope="session")
def tiny_env_policy(tmp_path_factory):
    """``tiny_env_policy(run_name, **overrides)``: ``(profile, policy)`` of the tiny demo model for an environment run,
    with random adapters so every context token matters, in fp32: the two paths then agree to rounding, whatever
    the sequence lengths (bf16 kernels move a log-prob by up to ~0.02 when the same tokens come in a longer, padded
    sequence)."""
    def make(run_name: str, **overrides):
        from orbitctl.builder import load_policy, prepare_frozen_base
        from orbitctl.data.prompts import PromptSplit
        from orbitctl.model.adapters import randomize_adapters
        from orbitctl.profile import load_profile

        fp32 = {"quant.compute_dtype": "fp32", "adapter.dtype": "fp32"}
        profile = load_profile(small_profile_yaml(tmp_path_factory.mktemp(run_name), run_name, **overrides, **fp32))
        # an environment run's base is warm-started as for prompt files: PromptSplit's default task
        policy = load_policy(profile, prepare_frozen_base(profile, PromptSplit([], [], None).warm_task))
        randomize_adapters(policy.model, seed=0, std=0.05)
        return profile, policy

    return make
