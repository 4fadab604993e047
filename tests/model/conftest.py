"""The tiny INT4 MoE the model tests share: DeepSeek-V3-type, 8 routed experts (top-2), 3 layers (1 dense, 2 MoE)."""

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
