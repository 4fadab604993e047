"""``rollout.batch_size: auto``: the most sequences the rollout phase fits per GPU, by the plan; train, the dry run
and eval decode that many; the plan's advice proposes it where the profile decodes fewer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from orbitctl.plan import apply_changes, auto_rollout_batch, plan_profile, resolve_rollout_batch
from orbitctl.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"


def _rollout_bytes(profile, n: int) -> tuple[int, int]:
    plan = plan_profile(apply_changes(profile, {"rollout.batch_size": n}), with_advice=False)
    return sum(plan.phases["rollout"].values()), plan.usable_bytes


def test_auto_is_the_most_sequences_whose_rollout_phase_fits():
    profile = load_profile(KIMI)
    n = auto_rollout_batch(profile)
    assert 1 < n < profile.rl.prompts_per_step * profile.rl.group_size // profile.world_size
    fits, usable = _rollout_bytes(profile, n)
    over, _ = _rollout_bytes(profile, n + 1)
    assert fits <= usable < over


def test_auto_stops_at_the_steps_own_sequences_per_gpu():
    profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml")  # 32 prompts x 8 over 2 ranks; a CPU rank has room
    assert auto_rollout_batch(profile) == 32 * 8 // 2


def test_the_plan_resolves_auto_and_says_so():
    auto = load_profile(KIMI, ["rollout.batch_size=auto"])
    n = auto_rollout_batch(auto)
    plan = plan_profile(auto)
    assert plan.details["rollout_batch_size_auto"] == n
    assert plan.details["rollout_sequences_per_gpu"] == n
    assert any(f"rollout.batch_size auto: {n} sequences" in note for note in plan.notes)
    assert resolve_rollout_batch(auto).rollout.batch_size == n
    explicit = plan_profile(load_profile(KIMI, [f"rollout.batch_size={n}"]), with_advice=False)
    assert explicit.phases == plan.phases and explicit.timing.seconds == plan.timing.seconds


def test_the_advice_proposes_auto_with_the_rollout_time_it_saves():
    profile = load_profile(KIMI, ["rollout.batch_size=16"])  # 16 sequences at once (the profile decodes auto)
    plan = plan_profile(profile)
    advice = [a for a in plan.advice if a.change == {"rollout.batch_size": "auto"}]
    assert len(advice) == 1 and advice[0].fits and advice[0].set_values() == ["rollout.batch_size=auto"]
    n = auto_rollout_batch(profile)
    assert f"decode {n} sequences at once per GPU instead of 16" in advice[0].text
    faster = plan_profile(apply_changes(profile, {"rollout.batch_size": n}), with_advice=False)
    assert faster.timing.phases["rollout"].seconds < plan.timing.phases["rollout"].seconds
    # a profile that already decodes as many as fit gets no such advice
    assert not [a for a in plan_profile(apply_changes(profile, {"rollout.batch_size": n})).advice
                if "rollout.batch_size" in a.change]


def test_the_dry_run_decodes_the_resolved_number():
    from orbitctl.launch.dryrun import dry_run

    profile = load_profile(ROOT / "profiles" / "tiny-moe-cpu.yaml", ["rollout.batch_size=auto"])
    assert dry_run(profile).rollout["batch_size"] == auto_rollout_batch(profile)


def test_a_batch_size_that_is_neither_a_count_nor_auto_exits_2(tmp_path, one_error_line):
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "plan", str(KIMI), "--set",
                           "rollout.batch_size=most"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    one_error_line(done.stderr, "rollout.batch_size", "auto", "most")
