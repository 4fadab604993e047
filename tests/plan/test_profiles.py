"""Every shipped profile validates and plans; the reference setup fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbitctl.plan import plan_profile
from orbitctl.profile import load_profile


REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "profiles").glob("*.yaml"))


def test_all_shipped_profiles_are_found():
    names = {p.name for p in PROFILES}
    assert {"tiny-cpu.yaml", "kimi-k2_grpo_int4_8xb200.yaml", "kimi-k2_grpo_int4_8xh200.yaml",
            "deepseek-v3_grpo_int4_8xh200.yaml", "qwen3-235b-a22b_grpo_int4_8xh100.yaml",
            "llama-3.1-70b_grpo_qlora-nf4_2x24g.yaml", "llama-3.1-8b_grpo_qlora-nf4_1x24g.yaml"} <= names


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_profile_validates_and_plans(path):
    profile = load_profile(path)
    plan = plan_profile(profile)
    assert plan.peak_bytes > 0 and plan.peak_phase in plan.phases
    assert plan.peak_bytes == max(plan.phase_peak_bytes.values())
    assert plan.params_trainable > 0
    text = path.read_text()
    assert text.startswith("#"), "a shipped profile opens with a header comment"
    assert f"orbitctl " in text.split("name:")[0], "the header shows the exact command"


@pytest.mark.parametrize("path", [p for p in PROFILES if p.stem != "tiny-cpu"], ids=lambda p: p.stem)
def test_shipped_gpu_profiles_fit(path):
    plan = plan_profile(load_profile(path))
    assert plan.fits, plan.verdict()
    assert plan.max_micro_batch >= load_profile(path).memory.micro_batch_size


def test_kimi_b200_reference_numbers(kimi_b200):
    from orbitctl.plan import apply_changes

    plan = plan_profile(kimi_b200)
    gib = 2**30
    # expert parallelism 8: 48 of 384 INT4 g32 experts per GPU; the bf16 dense part whole on every GPU
    assert plan.per_gpu_bytes["routed_experts"] / gib == pytest.approx(66.4, abs=0.1)
    assert plan.per_gpu_bytes["base_weights"] / gib == pytest.approx(22.1, abs=0.1)
    assert plan.per_gpu_bytes.get("zero3_gather", 0) == 0
    assert plan.params_total / 1e9 == pytest.approx(1026.4, abs=0.1)
    # the base's ZeRO-3 layout: 594.2 GB over 8 GPUs, all 384 experts of a layer gathered with one prefetched: ~18 GiB
    sharded = plan_profile(apply_changes(kimi_b200, {"memory.expert_parallel": 1, "memory.zero_stage": 3,
                                                     "memory.dense_layout": "sharded"}), with_advice=False)
    base = sharded.per_gpu_bytes["base_weights"] + sharded.per_gpu_bytes["routed_experts"]
    assert base / gib == pytest.approx(69.2, abs=0.1)
    assert 17 < sharded.per_gpu_bytes["zero3_gather"] / gib < 19


@pytest.mark.parametrize("path", [p for p in PROFILES if p.stem.startswith(("kimi", "deepseek", "qwen3"))],
                         ids=lambda p: p.stem)
def test_shipped_moe_profiles_use_the_layout_that_sends_least(path):
    plan = plan_profile(load_profile(path))
    rows = {row["layout"]: row for row in plan.layouts}
    assert len(rows) == 4
    current = next(row for row in plan.layouts if row["current"])
    assert current["best"] and current["fits"] and current["layout"] == "EP 8, dense replicated"
    assert current["total_bytes"] * 5 < rows["EP 8, dense sharded"]["total_bytes"] < rows["EP 1, dense sharded"]["total_bytes"]
    text = path.read_text()
    assert "expert_parallel: 8" in text and "dense_layout: replicated" in text and "Why this layout" in text
