"""What the model tests share: the tiny INT4 MoE (DeepSeek-V3-type, 8 routed experts (top-2), 3 layers (1 dense,
2 MoE)), and a shipped profile's policy as train builds it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def int4_moe(tmp_path_factory):
    """Its routed experts in orbitctl's INT4 format, everything else fp32; the path of the quantized checkpoint."""
    from orbitctl.model.tiny import build_tiny_model
    from orbitctl.quant.convert import quantize_checkpoint

    root = tmp_path_factory.mktemp("moe")
    src = build_tiny_model("deepseek_v3", root / "hf", n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
                           max_shard_size="60KB", dtype="float32")
    out = root / "int4"
    quantize_checkpoint(src, out, fmt="int4", group_size=32, modules="experts", skip=["lm_head"],
                        compute_dtype="float32", max_shard_bytes=60_000)
    return out


@pytest.fixture
def profile_policy(tmp_path_factory, model_cache):
    """``load(name, **sets)``: the policy of ``profiles/name`` with ``sets`` overrides, as train builds it (a run
    directory of its own), with the profile's prompt split and the profile: ``(policy, split, profile)``."""
    from pathlib import Path

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    def load(name: str, **sets):
        profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / name,
                               [f"run.dir={tmp_path_factory.mktemp('run')}", *(f"{k}={v}" for k, v in sets.items())])
        split = load_prompts(profile.data, profile.run.seed)
        return load_policy(profile, prepare_frozen_base(profile, split.warm_task)), split, profile

    return load
