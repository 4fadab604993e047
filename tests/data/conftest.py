"""A short demo profile that trains on a data file."""

from pathlib import Path

import pytest

SHORT = {
    "rl.prompts_per_step": 4, "rl.group_size": 2, "memory.micro_batch_size": 8, "rollout.batch_size": 8,
    "rl.steps": 2, "rl.warmup_steps": 0, "run.eval_every": 100, "run.save_every": 100, "data.eval_size": 2,
}


@pytest.fixture
def data_profile(tmp_path, write_demo_profile):
    """``data_profile(data_file, run_name, **overrides)``: the demo profile shrunk to two short steps on
    ``data_file``, with dotted-key overrides; returns the profile's path."""

    def make(data_file, run_name="run", **overrides) -> Path:
        settings = {**SHORT, "run.dir": str(tmp_path / run_name), "data.train": str(data_file),
                    "data.reward": "math", **overrides}
        return write_demo_profile(tmp_path / f"{run_name}.yaml", settings)

    return make
