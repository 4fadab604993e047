"""Synthetic run directories: metrics.jsonl, profile.yaml and summary.json written by the tests themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "profiles" / "tiny-cpu.yaml"

STEPS = 30
WINDOW = 10
BEST_REWARD_STEP = 17
ENTROPY_JUMP_STEP = 25
PREDICTED = {"rollout": 1000, "policy_update": 2000}
"""What the train process wrote as its prediction; the report plans the profile itself."""


def planted_entropy(step: int) -> float:
    """Within ±1% around 1.0, except one jump at ENTROPY_JUMP_STEP."""
    return 1.2 if step == ENTROPY_JUMP_STEP else 1.0 + 0.01 * (-1) ** step


def planted_record(step: int) -> dict:
    reward = 0.95 if step == BEST_REWARD_STEP else 0.2 + 0.02 * step
    record = {
        "step": step, "samples": 64 * step, "tokens": 128, "reward_mean": reward, "reward_std": 0.1,
        "accuracy": reward / 2, "entropy": planted_entropy(step),
        "mismatch_k3_kl": 1e-5 * step, "mismatch_logp_abs_mean": 1e-3 * step, "grad_norm": 0.5 + 0.01 * step,
        "lr": 1e-3, "time_rollout_s": 0.1 + 0.001 * step, "time_reward_s": 0.001, "time_update_s": 0.2,
        "samples_per_s": 100.0 + step, "tokens_per_s": 200.0 + 2 * step,
        "phase_memory": {"rollout": {"predicted_bytes": PREDICTED["rollout"],
                                     "measured_bytes": [100_000_000 + step, 90_000_000]},
                         "policy_update": {"predicted_bytes": PREDICTED["policy_update"],
                                           "measured_bytes": [150_000_000, 160_000_000 + 2 * step]}},
        "phase_memory_kind": "rss_rise",
        "warnings": [],
    }
    if step % 10 == 0:
        record.update(eval_accuracy=0.3 + step / 100, eval_reward=0.3, eval_prompts=16)
    if step in (12, 20):
        record["warnings"] = ["gradient-norm spike: 5.0, over 10x the recent median 0.5"]
    if step == 22:
        record["warnings"] = ["entropy collapse"]
    return record


def write_run(root: Path, records: list[dict] | None = None, *, summary: dict | None = None,
              **profile_overrides) -> Path:
    """A run directory holding ``records`` (default: the planted ones) and a valid tiny-cpu profile."""
    root.mkdir(parents=True, exist_ok=True)
    records = [planted_record(s) for s in range(1, STEPS + 1)] if records is None else records
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    profile = yaml.safe_load(DEMO.read_text())
    for key, value in {"alignment.entropy_window": WINDOW, "run.dir": str(root), **profile_overrides}.items():
        node = profile
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    (root / "profile.yaml").write_text(yaml.safe_dump(profile))
    document = {"status": "finished", "eval_before": 0.25, "eval_after": 0.6} if summary is None else summary
    (root / "summary.json").write_text(json.dumps(document))
    return root


@pytest.fixture
def make_run(tmp_path):
    """``make_run(name, records=None, summary=None, **profile_overrides)``: a run directory under tmp_path."""
    return lambda name="run", records=None, summary=None, **overrides: write_run(
        tmp_path / name, records, summary=summary, **overrides)


@pytest.fixture
def planted():
    """The planted run's constants and generators (conftest is not importable under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(STEPS=STEPS, WINDOW=WINDOW, BEST_REWARD_STEP=BEST_REWARD_STEP,
                           ENTROPY_JUMP_STEP=ENTROPY_JUMP_STEP, entropy=planted_entropy, record=planted_record)
