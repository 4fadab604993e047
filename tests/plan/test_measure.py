"""--measure: the analytic activation+logit terms against one fake-tensor training step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from orbitctl.plan import measure_profile  # noqa: E402

# tiny but not degenerate: widths where per-token terms dominate, a vocabulary larger than hidden
DENSE = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024}
MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 352, "moe_intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
       "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 1024}


def _profile(make_profile, tmp_path, config, checkpointing, targets="attention+shared"):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return make_profile(model={"config": str(path)}, hardware={"gpu": "cpu", "gpus_per_node": 1},
                        adapter={"rank": 8, "targets": targets},
                        memory={"micro_batch_size": 2, "seq_len": 256, "zero_stage": 0,
                                "gradient_checkpointing": checkpointing})


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_activation_estimate_within_15_percent(make_profile, tmp_path, config, checkpointing):
    m = measure_profile(_profile(make_profile, tmp_path, config, checkpointing))
    row = m.rows[0]
    assert row["component"] == "activations+logits"
    assert row["measured_bytes"] > 0
    assert row["predicted_bytes"] == pytest.approx(row["measured_bytes"], rel=0.15)


def test_measured_states_match_the_plan(make_profile, tmp_path):
    m = measure_profile(_profile(make_profile, tmp_path, DENSE, True, targets="all-linear"))
    rows = {r["component"]: r for r in m.rows}
    assert rows["adapter_weights"]["measured_bytes"] == rows["adapter_weights"]["predicted_bytes"]
    assert rows["base_weights (bf16 copy)"]["measured_bytes"] == pytest.approx(
        rows["base_weights (bf16 copy)"]["predicted_bytes"], rel=0.01)
    assert m.calibrated_bytes["activations"] > 0 and m.activation_ratio > 0
