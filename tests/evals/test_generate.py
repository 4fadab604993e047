"""`orbitctl eval PROFILE`: generation on the tiny demo model, with and without a trained adapter."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from orbitctl.cli.app import app, main

torch = pytest.importorskip("torch")

HELD_OUT = 12


@pytest.fixture
def mod3_file(tmp_path, demo_base):
    """Held-out prompts of the demo's builtin task, as a prompt/answer JSONL file."""
    from orbitctl.data.tasks import builtin_task

    task = builtin_task("mod3")
    items = [it for it in task.items() if task.is_eval(it)][:HELD_OUT]
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": it.prompt, "answer": it.answer}) + "\n" for it in items))
    return path


@pytest.fixture
def adapter_dir(tmp_path, profile_yaml):
    """An adapter for the demo profile whose LoRA weights are far from the fresh (zero) ones."""
    from orbitctl.evals.runner import build_policy
    from orbitctl.model.adapters import save_adapter
    from orbitctl.profile import load_profile

    policy = build_policy(load_profile(profile_yaml()), None)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in policy.named_trainable():
            param.copy_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.5)
    path = tmp_path / "adapter"
    save_adapter(policy.model, path, policy.adapter_kind, policy.hidden_size)
    return path


def test_base_accuracy_is_the_trainers_greedy_eval(tmp_path, profile_yaml, mod3_file, eval_json):
    from orbitctl.data.prompts import read_jsonl
    from orbitctl.evals.runner import build_policy
    from orbitctl.model.adapters import adapters_disabled
    from orbitctl.profile import load_profile
    from orbitctl.rl.rewards import make_reward
    from orbitctl.rl.rollout import evaluate
    from orbitctl.data.tasks import builtin_task

    profile = profile_yaml()
    out = tmp_path / "graded.jsonl"
    doc = eval_json(str(profile), "--suite", str(mod3_file), "--out", str(out))
    assert doc["metric"] == "accuracy" and doc["grader"] == "builtin" and doc["mode"] == "generate"
    assert doc["tasks"] == HELD_OUT and doc["samples"] == HELD_OUT and doc["samples_per_task"] == 1
    assert doc["sampling"]["temperature"] == 0.0 and doc["adapter"] is None
    accuracy = doc["scores"]["pass@1"]["value"]
    assert 0.0 <= accuracy <= 1.0 and doc["scores"]["pass@1"]["interval"] == "wilson"

    # the same number from the trainer's own held-out evaluation of the base
    loaded = load_profile(profile)
    policy = build_policy(loaded, None)
    items = read_jsonl(mod3_file)
    with adapters_disabled(policy.model):
        sums = evaluate(policy, items, make_reward("builtin", builtin_task("mod3")), batch_size=8,
                        max_new_tokens=loaded.rollout.max_new_tokens, generator=None)
    assert accuracy == pytest.approx(sums["correct"] / sums["total"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == HELD_OUT and sum(r["passed"] for r in rows) == round(accuracy * HELD_OUT)


def test_adapter_changes_what_is_generated(tmp_path, profile_yaml, mod3_file, adapter_dir, eval_json):
    profile = str(profile_yaml())
    base_out, tuned_out = tmp_path / "base.jsonl", tmp_path / "tuned.jsonl"
    base = eval_json(profile, "--suite", str(mod3_file), "--samples", "4", "--k", "1", "--k", "4",
                     "--out", str(base_out))
    tuned = eval_json(profile, "--suite", str(mod3_file), "--samples", "4", "--k", "1", "--k", "4",
                 "--adapter", str(adapter_dir), "--out", str(tuned_out))
    for doc in (base, tuned):
        assert doc["samples"] == 4 * HELD_OUT and doc["samples_per_task"] == 4 and doc["tasks"] == HELD_OUT
        assert doc["sampling"]["temperature"] == 0.8
        low, high = doc["scores"]["pass@1"]["value"], doc["scores"]["pass@4"]["value"]
        assert 0.0 <= low <= high <= 1.0
    assert tuned["adapter"] == str(adapter_dir)
    completions = [[json.loads(line)["completion"] for line in path.read_text().splitlines()]
                   for path in (base_out, tuned_out)]
    assert completions[0] != completions[1]
    # the same request draws the same completions (keyed draws, not the batch)
    again = tmp_path / "again.jsonl"
    eval_json(profile, "--suite", str(mod3_file), "--samples", "4", "--k", "1", "--out", str(again),
         "--set", "rollout.batch_size=5")
    assert [json.loads(line)["completion"] for line in again.read_text().splitlines()] == completions[0]


@pytest.mark.parametrize("args, needles", [
    (["--samples", "4", "--k", "5"], ["--k 5", "--samples"]),
    (["--suite", "missing.jsonl"], ["missing.jsonl", "not found"]),
    (["--suite", "gsm8k"], ["gsm8k", "--data"]),
    (["--adapter", "no/such/dir"], ["no/such/dir"]),
    (["--timeout", "3"], ["--timeout"]),
])
def test_bad_requests_exit_2(profile_yaml, mod3_file, capsys, one_error_line, args, needles):
    args = args if "--suite" in args else ["--suite", str(mod3_file), *args]
    assert main(["eval", str(profile_yaml()), *args]) == 2
    one_error_line(capsys.readouterr().err, *needles)


def test_the_cli_is_thin(monkeypatch, profile_yaml):
    import orbitctl.evals.api as api

    seen = {}

    def fake(profile_path, overrides, **kwargs):
        seen.update(profile_path=profile_path, overrides=overrides, **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(api, "evaluate", fake)
    result = CliRunner().invoke(app, ["eval", "p.yaml", "--suite", "gsm8k", "--data", "d.jsonl", "--samples", "10",
                                      "--k", "1", "--k", "10", "--temperature", "0.2", "--max-new-tokens", "64",
                                      "--limit", "5", "--out", "o.jsonl", "--set", "run.seed=3", "--json"])
    assert result.exit_code == 0, result.output
    assert seen == {"profile_path": "p.yaml", "overrides": ["run.seed=3"], "suite": "gsm8k", "data": "d.jsonl",
                    "adapter": None, "completions": None, "samples": 10, "k": [1, 10], "temperature": 0.2,
                    "max_new_tokens": 64, "limit": 5, "timeout_s": None, "out": "o.jsonl", "on_progress": None}
