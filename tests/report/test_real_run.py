"""A report of a real (short) training run: every field train logs lands where the report expects it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FAST = {"rl.prompts_per_step": 8, "rl.group_size": 4, "memory.micro_batch_size": 32, "rollout.batch_size": 32,
        "rl.steps": 4, "rl.warmup_steps": 0, "run.eval_every": 2, "run.save_every": 100, "data.eval_size": 16,
        "alignment.entropy_window": 3}


@pytest.mark.slow
def test_report_of_a_real_training_run(tmp_path):
    from orbitctl.cli.app import main

    profile = yaml.safe_load((REPO / "profiles" / "tiny-cpu.yaml").read_text())
    for key, value in {**FAST, "run.dir": str(tmp_path / "real")}.items():
        section, leaf = key.split(".")
        profile.setdefault(section, {})[leaf] = value
    path = tmp_path / "real.yaml"
    path.write_text(yaml.safe_dump(profile))
    env = dict(os.environ)
    if env.get("ORBITCTL_TEST_CACHE"):
        env["ORBITCTL_CACHE"] = env["ORBITCTL_TEST_CACHE"]
    train = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(path), "--json"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    run_dir = tmp_path / "real"
    assert main(["report", str(run_dir)]) == 0
    document = json.loads((run_dir / "report" / "summary.json").read_text())
    run = document["runs"][0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run["steps"]["logged"] == 4 and run["status"] == "finished"
    assert run["reward"]["last"] == records[-1]["reward_mean"]
    assert run["eval"]["before"] == summary["eval_before"] and run["eval"]["after"] == summary["eval_after"]
    assert [s for s, _ in run["eval"]["points"]] == [0, 2, 4]
    assert run["entropy"]["verdict"] in ("stable", "unstable") and run["entropy"]["window"] == 3
    for phase, entry in run["memory"]["phases"].items():  # the plan the run predicted is the plan the report makes
        assert entry["predicted_bytes"] == records[-1]["phase_memory"][phase]["predicted_bytes"]
        assert entry["measured_peak_bytes"] == max(max(r["phase_memory"][phase]["measured_bytes"]) for r in records)
    assert set(run["memory"]["phases"]) == {"rollout", "policy_update"}
    assert run["step_time_s"]["median"] > 0 and run["throughput"]["samples_per_s_median"] > 0
