"""summary.json says what the planted metrics hold, and judges entropy exactly as verify-alignment does."""

from __future__ import annotations

import math
import statistics

import pytest

from orbitctl.report import build_summary
from orbitctl.report.entropy import judge_entropy
from orbitctl.report.runs import load_runs


def _summary(path):
    return build_summary(load_runs([path]))["runs"][0]


def test_summary_holds_the_planted_values(make_run, planted):
    from orbitctl.plan import plan_profile
    from orbitctl.profile import load_profile

    STEPS, planted_record = planted.STEPS, planted.record
    run = _summary(make_run("planted"))
    records = [planted_record(s) for s in range(1, STEPS + 1)]
    assert run["name"] == "planted" and run["status"] == "finished"
    assert run["steps"] == {"logged": STEPS, "first": 1, "last": STEPS}
    rewards = [r["reward_mean"] for r in records]
    assert run["reward"] == {"first": rewards[0], "last": rewards[-1], "best": max(rewards), "best_step": planted.BEST_REWARD_STEP}
    assert run["accuracy"]["best"] == max(rewards) / 2 and run["accuracy"]["best_step"] == planted.BEST_REWARD_STEP
    assert run["eval"]["before"] == 0.25 and run["eval"]["after"] == 0.6
    assert run["eval"]["points"] == [[0, 0.25]] + [[s, 0.3 + s / 100] for s in (10, 20, 30)]
    edge = STEPS // 10
    k3 = [r["mismatch_k3_kl"] for r in records]
    assert run["mismatch"]["mismatch_k3_kl"]["first"] == pytest.approx(math.fsum(k3[:edge]) / edge)
    assert run["mismatch"]["mismatch_k3_kl"]["last"] == pytest.approx(math.fsum(k3[-edge:]) / edge)
    assert run["mismatch"]["mismatch_k3_kl"]["max"] == max(k3)
    times = [r["time_rollout_s"] + r["time_reward_s"] + r["time_update_s"] for r in records]
    assert run["step_time_s"]["median"] == pytest.approx(statistics.median(times))
    assert run["throughput"]["samples_per_s_median"] == statistics.median(r["samples_per_s"] for r in records)
    assert run["warnings"] == [
        {"message": records[11]["warnings"][0], "first_step": 12, "steps": 2},
        {"message": "entropy collapse", "first_step": 22, "steps": 1}]
    # memory: the largest rank's peak over the run, against the plan the run recorded (train's own, its auto dtypes
    # resolved on its device), not a plan made again here
    plan = {phase: entry["predicted_bytes"] for phase, entry in records[-1]["phase_memory"].items()}
    replanned = plan_profile(load_profile(make_run("planted") / "profile.yaml"), with_advice=False).phase_peak_bytes
    assert plan != dict(replanned)
    memory = run["memory"]
    assert memory["kind"] == "rss_rise" and set(memory["phases"]) == {"rollout", "policy_update"}
    rollout, update = memory["phases"]["rollout"], memory["phases"]["policy_update"]
    assert (rollout["measured_peak_bytes"], rollout["peak_step"]) == (100_000_000 + STEPS, STEPS)
    assert update["measured_peak_bytes"] == 160_000_000 + 2 * STEPS
    assert rollout["predicted_bytes"] == plan["rollout"] and update["predicted_bytes"] == plan["policy_update"]
    assert rollout["ratio"] == pytest.approx((100_000_000 + STEPS) / plan["rollout"])


def test_entropy_leaving_the_band_is_named_with_its_step(make_run, planted):
    STEPS, WINDOW, JUMP = planted.STEPS, planted.WINDOW, planted.ENTROPY_JUMP_STEP
    entropy = _summary(make_run("jump"))["entropy"]
    values = [planted.entropy(s) for s in range(1, STEPS + 1)]
    assert entropy["verdict"] == "unstable" and entropy["window"] == WINDOW and entropy["fluctuation_max"] == 0.05
    # the first window holding the jump ends at it; every window holding it is over the gate, no other
    assert entropy["first_unstable_window"] == [JUMP - WINDOW + 1, JUMP]
    assert entropy["left_band_at_step"] == JUMP
    assert entropy["unstable_windows"] == STEPS - JUMP + 1
    windows = [values[i:i + WINDOW] for i in range(STEPS - WINDOW + 1)]
    worst = max((max(w) - min(w)) / (math.fsum(w) / WINDOW) for w in windows)
    assert entropy["worst_fluctuation"] == pytest.approx(worst, rel=1e-12)


def test_steady_entropy_is_stable(make_run, planted):
    records = [{**planted.record(s), "entropy": 1.0 + 0.01 * (-1) ** s} for s in range(1, planted.STEPS + 1)]
    entropy = _summary(make_run("steady", records))["entropy"]
    assert entropy["verdict"] == "stable" and entropy["unstable_windows"] == 0
    assert entropy["left_band_at_step"] is None and entropy["worst_fluctuation"] == pytest.approx(0.02 / 1.0, rel=1e-3)


@pytest.mark.parametrize("window,steps", [(10, 30), (100, 30), (2, 5), (7, 200)])
def test_entropy_windows_agree_with_verify_alignment(window, steps):
    import random

    from orbitctl.align.trends import entropy_stability

    rng = random.Random(window * steps)
    records = [{"step": s, "entropy": 1.0 + rng.uniform(-0.05, 0.05)} for s in range(1, steps + 1)]
    records[steps // 2]["entropy"] = None  # a skipped update: left out by both
    theirs = entropy_stability(records, window)
    ours = judge_entropy([(r["step"], r["entropy"]) for r in records if r["entropy"] is not None], window, 0.05)
    assert ours.worst.fluctuation == pytest.approx(theirs.worst_fluctuation, rel=1e-12)
    assert (ours.worst.first_step, ours.worst.last_step) == theirs.worst_window
    assert ours.full_windows == theirs.full_windows and ours.steps == theirs.steps
    assert (ours.verdict == "stable") == (theirs.worst_fluctuation < 0.05)


def test_too_little_entropy_is_not_logged(make_run, planted):
    records = [{**planted.record(s), "entropy": None} for s in range(1, 4)]
    records[0]["entropy"] = 0.5
    entropy = _summary(make_run("one-entropy", records))["entropy"]
    assert entropy["verdict"] == "not logged" and entropy["worst_window"] is None
