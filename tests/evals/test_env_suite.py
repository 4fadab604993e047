"""`orbitctl eval PROFILE --suite env:NAME`: an environment's held-out seeds played on the tiny model."""

import json

import pytest

from orbitctl.cli.app import main

pytest.importorskip("torch")

ENV = ["--set", "data.train=env:guess", "--set", "rollout.max_turns=4"]


def test_a_completion_rate_with_its_interval_on_the_held_out_seeds(profile_yaml, demo_base, tmp_path, eval_json):
    from orbitctl.profile import load_profile
    from orbitctl.rl.envs import environment, held_out_seeds

    profile = profile_yaml()
    out = tmp_path / "episodes.jsonl"
    doc = eval_json(str(profile), *ENV, "--suite", "env:guess", "--limit", "12", "--out", str(out))
    assert doc["metric"] == "completion" and doc["grader"] == "environment" and doc["format"] == "episodes"
    assert doc["tasks"] == 12 and doc["samples"] == 12 and doc["sampling"]["max_turns"] == 4
    score = doc["scores"]["pass@1"]
    assert score["interval"] == "wilson" and 0.0 <= score["low"] <= score["value"] <= score["high"] <= 1.0
    assert score["high"] - score["low"] > 0.1  # 12 seeds: a wide interval, whatever the rate
    episodes = doc["episodes"]
    assert episodes["episodes"] == 12 and episodes["completed"] == round(score["value"] * 12)
    assert episodes["tool_call_valid_rate"] is None  # env:guess is played in plain text
    if episodes["completed"]:
        assert 1 <= episodes["mean_turns_to_success"] <= 4
    # the seeds are the first of the held-out pool train keeps for the same profile, never a train seed
    loaded = load_profile(profile, ["data.train=env:guess", "rollout.max_turns=4"])
    train, held = held_out_seeds(environment("env:guess"), loaded.data, loaded.run.seed)
    assert [t["task_id"] for t in doc["per_task"]] == [f"env:guess#{s}" for s in held[:12]]
    assert not {int(t["task_id"].split("#")[1]) for t in doc["per_task"]} & set(train)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12 and sum(r["completed"] for r in rows) == episodes["completed"]
    assert all(1 <= r["turns"] <= 4 and r["transcript"] for r in rows)


def test_pass_at_k_over_sampled_episodes(profile_yaml, demo_base, eval_json):
    doc = eval_json(str(profile_yaml()), *ENV, "--suite", "env:guess", "--limit", "4", "--samples", "3", "--k", "1",
               "--k", "3")
    assert doc["samples"] == 12 and doc["samples_per_task"] == 3 and doc["sampling"]["temperature"] == 0.8
    assert set(doc["scores"]) == {"pass@1", "pass@3"}
    assert doc["scores"]["pass@3"]["value"] >= doc["scores"]["pass@1"]["value"]


@pytest.mark.parametrize("args, needles", [
    (["--suite", "env:chess"], ["env:chess", "env:guess"]),
    (["--suite", "env:household"], ["data.chat_template"]),
    (["--suite", "env:guess", "--data", "x.jsonl"], ["--data"]),
    (["--suite", "env:guess", "--timeout", "3"], ["--timeout"]),
])
def test_bad_environment_requests_exit_2(profile_yaml, capsys, one_error_line, args, needles):
    assert main(["eval", str(profile_yaml()), *ENV, *args]) == 2
    one_error_line(capsys.readouterr().err, *needles)
