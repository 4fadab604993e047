"""Per-phase memory: a phase's measured peak sees what the phase allocates, and the ratio to the plan is judged."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from orbitctl.rl.phases import RATIO_BAND, SLACK_BYTES, PhaseMemory  # noqa: E402
from orbitctl.units import MiB  # noqa: E402


def test_a_phase_measures_what_it_allocates_on_the_cpu():
    meter = PhaseMemory({"rollout": 1, "policy_update": 1})
    with meter.phase("rollout"):
        block = torch.ones(96 * MiB // 4)  # 96 MiB, touched
        del block
    with meter.phase("policy_update"):
        pass
    assert meter.kind in ("rss_rise", "rss_rise_lifetime")
    assert meter.measured["rollout"] >= 90 * MiB
    if meter.kind == "rss_rise":  # the high-water mark was reset for the second phase
        assert meter.measured["policy_update"] < meter.measured["rollout"]


def test_the_ratio_is_judged_once_per_excursion():
    meter = PhaseMemory({"rollout": 1024 * MiB, "policy_update": None})
    meter.measured = {"rollout": int(1024 * MiB * (RATIO_BAND[1] + 0.3))}
    first = meter.report()
    entry = first["phase_memory"]["rollout"]
    assert entry["predicted_bytes"] == 1024 * MiB and entry["measured_bytes"] == [meter.measured["rollout"]]
    assert entry["ratio"] == pytest.approx(RATIO_BAND[1] + 0.3)
    assert len(first["memory_warnings"]) == 1 and "rollout" in first["memory_warnings"][0]
    assert meter.report()["memory_warnings"] == []  # still outside: said once
    meter.measured["rollout"] = 1024 * MiB  # back inside, then out again: said again
    assert meter.report()["memory_warnings"] == []
    meter.measured["rollout"] = 3 * 1024 * MiB
    assert len(meter.report()["memory_warnings"]) == 1
    assert "ratio" not in meter.report()["phase_memory"]["policy_update"]  # no prediction, no ratio


def test_a_phase_that_ran_part_of_what_the_plan_counts_is_kept_apart_and_not_judged():
    meter = PhaseMemory({"rollout": 1024 * MiB, "policy_update": 4096 * MiB})
    with meter.phase("policy_update") as ran:
        block = torch.ones(96 * MiB // 4)
        del block
        ran.full = False  # an update that left out its rows without a gradient
    assert "policy_update" not in meter.measured and meter.partial["policy_update"] >= 90 * MiB
    report = meter.report()
    entry = report["phase_memory"]["policy_update"]
    assert entry["measured_bytes"] == [None] and entry["partial_bytes"] == [meter.partial["policy_update"]]
    assert "ratio" not in entry and report["memory_warnings"] == []  # 0.02 of the plan, and no warning
    with meter.phase("policy_update"):  # a full one is judged
        pass
    assert "policy_update" in meter.measured and "ratio" in meter.report()["phase_memory"]["policy_update"]


def test_small_differences_are_not_warned_whatever_the_ratio():
    meter = PhaseMemory({"rollout": 8 * MiB, "policy_update": None})
    meter.measured = {"rollout": 8 * MiB + SLACK_BYTES // 2}
    assert meter.report()["memory_warnings"] == []


@pytest.mark.slow
def test_a_run_that_builds_its_base_measures_what_a_cached_run_measures(profile_yaml):
    """The baseline is taken before the base is built: what building it imports (the model code, the tokenizer)
    is in the phases' rise as it is when the base comes from the cache and is only loaded."""
    import json
    import subprocess
    import sys

    from orbitctl.rundir import read_metrics

    rises = []
    for run in ("builds", "cached"):  # a seed no other test uses: the first run builds its demo base
        path = profile_yaml(run, **{"run.seed": 11, "rl.steps": 2})
        done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(path), "--json"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        last = read_metrics(json.loads(done.stdout)["run_dir"])[-1]  # stdout is the one JSON document
        rises.append({phase: m["measured_bytes"][0] for phase, m in last["phase_memory"].items()})
    built, cached = rises
    for phase in cached:
        assert 0.8 <= built[phase] / cached[phase] <= 1.25, (phase, built, cached)


def test_the_cpu_measures_the_first_steps_and_every_tenth_leaving_the_allocator_fast_between(monkeypatch):
    """Pinned at 1 MiB every multi-MiB allocation faults its pages in; between measured steps the threshold is
    glibc's largest, and a step not measured records nothing (the peaks are the measured steps')."""
    import orbitctl.rl.phases as phases

    pinned = []
    monkeypatch.setattr(phases, "pin_mmap_threshold", lambda nbytes, **trim: pinned.append(nbytes) or True)
    meter = PhaseMemory({"rollout": 1, "policy_update": 1})
    measured = []
    for step in range(12):
        measured.append(meter.measuring)
        pinned.clear()
        with meter.phase("rollout"):
            block = torch.ones((8 if step == 5 else 1) * 24 * MiB // 4)  # step 5 allocates the most, unmeasured
            del block
        assert pinned == [phases.MMAP_THRESHOLD_BYTES if measured[-1] else phases.FAST_MMAP_THRESHOLD_BYTES]
        meter.report()
    assert measured == [True, True] + [False] * 8 + [True, False]
    assert meter.measured["rollout"] < 8 * 24 * MiB
