"""Every advice line of every shipped profile, applied: the plan then shows the peak the advice claimed; advice that
promises the same global batch keeps micro-batch x accumulation x data-parallel ranks; advice that changes nothing
the plan shows is not given."""

from __future__ import annotations

import pytest

from orbitctl.plan import apply_changes, plan_profile
from orbitctl.profile import load_profile

from .test_timing import PROFILES


def _global_batch(profile) -> int:
    return profile.memory.micro_batch_size * profile.memory.gradient_accumulation_steps * profile.world_size


@pytest.mark.parametrize("name", PROFILES)
def test_every_advice_line_does_what_it_says(repo, name):
    profile = load_profile(str(repo / "profiles" / f"{name}.yaml"))
    plan = plan_profile(profile)
    for advice in plan.advice:
        after = plan_profile(apply_changes(profile, advice.change), with_advice=False)
        assert after.peak_bytes == advice.peak_bytes and after.fits == advice.fits, advice.text
        assert f"peak {after.peak_bytes / 2 ** 30:.1f} GiB" in advice.text, advice.text
        if "same global batch" in advice.text:
            assert _global_batch(apply_changes(profile, advice.change)) == _global_batch(profile), advice.text
        # it changes something the plan shows: the peak, the verdict, or the batch it trains or decodes at
        changed = after.peak_bytes != plan.peak_bytes or after.fits != plan.fits or any(
            key in advice.change for key in ("memory.micro_batch_size", "rollout.batch_size"))
        assert changed, advice.text
        if "memory.micro_batch_size" in advice.change and "raise" not in advice.text:
            assert after.peak_bytes < plan.peak_bytes or (after.fits and not plan.fits), advice.text


def test_lowering_the_micro_batch_keeps_the_global_batch_exactly(make_profile):
    """A micro-batch that fits but does not divide micro-batch x accumulation is never advised: 3 x 43 = 129 is not
    128."""
    from orbitctl.plan.advice import same_batch_micro_batch

    assert same_batch_micro_batch(128, 3) == 2 and same_batch_micro_batch(64, 8) == 8
    assert same_batch_micro_batch(72, 7) == 6 and same_batch_micro_batch(5, 4) == 1
