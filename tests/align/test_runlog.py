"""A run's metrics.jsonl: entropy stability with known fluctuation, mismatch trends with known slopes."""

from __future__ import annotations

import json
import math
import random

import pytest

from orbitctl.align.trends import entropy_stability, mismatch_trends
from orbitctl.rundir import read_metrics
from orbitctl.errors import EXIT_BAD_INPUT, InputFileError, UserError


def write_run(tmp_path, records, tail: str = ""):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run


def entropy_records(values, start=1):
    return [{"step": start + i, "entropy": v, "reward_mean": 0.5} for i, v in enumerate(values)]


def test_planted_window_is_the_worst(tmp_path):
    values = [1.0] * 300
    values[149], values[150] = 0.96, 1.04  # steps 150 and 151
    result = entropy_stability(read_metrics(write_run(tmp_path, entropy_records(values))), 100)
    assert result.worst_fluctuation == pytest.approx(0.08, abs=1e-12)
    assert result.worst_window == (52, 151)  # the first 100-step window holding both
    assert (result.window, result.steps, result.full_windows) == (100, 300, True)


def test_sine_of_amplitude_a_fluctuates_by_2a_over_mean(tmp_path):
    a, mean, period = 0.03, 2.0, 20
    values = [mean + a * math.sin(2 * math.pi * s / period) for s in range(400)]
    result = entropy_stability(entropy_records(values), 100)
    assert result.worst_fluctuation == pytest.approx(2 * a / mean, rel=1e-9)


def test_sliding_window_matches_brute_force():
    rng = random.Random(3)
    values = [rng.uniform(0.5, 2.0) for _ in range(257)]
    records = entropy_records(values, start=10)
    for window in (2, 7, 100, 257):
        brute = max((max(values[i:i + window]) - min(values[i:i + window])) / (sum(values[i:i + window]) / window)
                    for i in range(len(values) - window + 1))
        result = entropy_stability(records, window)
        assert result.worst_fluctuation == pytest.approx(brute, rel=1e-12)
        first = result.worst_window[0] - 10
        assert result.worst_window[1] - result.worst_window[0] == window - 1
        chunk = values[first:first + window]
        assert (max(chunk) - min(chunk)) / (sum(chunk) / window) == pytest.approx(brute, rel=1e-12)


def test_short_run_is_judged_on_all_its_steps():
    result = entropy_stability(entropy_records([1.0, 1.1, 0.9, 1.0]), 100)
    assert result.full_windows is False and result.steps == 4 and result.worst_window == (1, 4)
    assert result.worst_fluctuation == pytest.approx(0.2 / 1.0)


def test_null_entropy_steps_are_skipped():
    records = entropy_records([1.0, None, 1.2, 1.0])
    result = entropy_stability(records, 2)
    assert result.steps == 3 and result.worst_window == (1, 3)
    assert result.worst_fluctuation == pytest.approx(0.2 / 1.1)


def test_torn_last_line_is_dropped_and_records_come_in_step_order(tmp_path):
    run = write_run(tmp_path, entropy_records([1.0, 2.0, 3.0], start=5)[::-1], tail='{"step": 8, "entr')
    assert [r["step"] for r in read_metrics(run)] == [5, 6, 7]


def test_damaged_middle_line_names_the_line(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "entropy": 1.0}\n{oops\n{"step": 3, "entropy": 1.0}\n')
    with pytest.raises(InputFileError, match=r"metrics\.jsonl:2: not JSON .* — fix: remove the damaged line"):
        read_metrics(run)


def test_missing_run_or_metrics_points_at_the_run_dir(tmp_path):
    with pytest.raises(InputFileError, match=r"no such run directory — fix: the run dir is runs/<profile name>, "
                                             r"or the profile's run\.dir") as info:
        read_metrics(tmp_path / "runs" / "nope")
    assert info.value.exit_code == EXIT_BAD_INPUT
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputFileError, match=r"no metrics\.jsonl in the run directory — fix: the run dir is runs/"):
        read_metrics(tmp_path / "empty")


def test_no_entropy_or_too_few_steps_are_refused():
    with pytest.raises(InputFileError, match=r"no entropy field in any record \(entropy\) — fix: "):
        entropy_stability([{"step": 1, "reward_mean": 0.1}, {"step": 2, "entropy": None}], 100)
    with pytest.raises(InputFileError, match=r"1 step with entropy; stability needs at least 2"):
        entropy_stability(entropy_records([1.0]), 100)
    with pytest.raises(UserError, match=r"alignment\.entropy_window: must be >= 2"):
        entropy_stability(entropy_records([1.0, 1.0]), 1)
    with pytest.raises(InputFileError, match=r"1 step\(s\) logged; a trend needs at least 2"):
        mismatch_trends(entropy_records([1.0]))


def test_mismatch_trends_with_known_slopes():
    records = [{"step": s, "entropy": 1.0,
                "mismatch_k3_kl": 1e-3 + 2e-5 * s,
                "mismatch_logp_abs_max": 0.5,
                "mismatch_prob_abs_mean": None,
                "mismatch_logp_abs_mean": 0.01 - 5e-5 * s if s % 2 else None}
               for s in range(1, 101)]
    trends = {t.metric: t for t in mismatch_trends(records)}
    assert set(trends) == {"mismatch_k3_kl", "mismatch_logp_abs_max", "mismatch_logp_abs_mean"}  # all-null skipped
    k3 = trends["mismatch_k3_kl"]
    assert k3.n == 100
    assert k3.slope_per_100_steps == pytest.approx(2e-3, rel=1e-9)
    assert k3.first == pytest.approx(1e-3 + 2e-5 * 5.5, rel=1e-12)    # steps 1..10
    assert k3.last == pytest.approx(1e-3 + 2e-5 * 95.5, rel=1e-12)    # steps 91..100
    assert k3.max == pytest.approx(1e-3 + 2e-5 * 100)
    flat = trends["mismatch_logp_abs_max"]
    assert (flat.first, flat.last, flat.max, flat.slope_per_100_steps) == (0.5, 0.5, 0.5, 0.0)
    odd = trends["mismatch_logp_abs_mean"]  # logged on odd steps only: the slope is still per step number
    assert odd.n == 50 and odd.slope_per_100_steps == pytest.approx(-5e-3, rel=1e-9)
    assert odd.first == pytest.approx(0.01 - 5e-5 * 5, rel=1e-12)     # steps 1, 3, 5, 7, 9


def test_short_trend_uses_at_least_one_step():
    (trend,) = mismatch_trends([{"step": 1, "mismatch_k3_kl": 0.002}, {"step": 2, "mismatch_k3_kl": 0.004}])
    assert (trend.first, trend.last, trend.max, trend.n) == (0.002, 0.004, 0.004, 2)
    assert trend.slope_per_100_steps == pytest.approx(0.2)
