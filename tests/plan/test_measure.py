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

# MLA attention, one dense + one MoE layer, the fp32 sigmoid router and a shared expert
MLA_MOE = {"model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
           "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
           "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
           "n_group": 1, "topk_group": 1, "vocab_size": 512, "max_position_embeddings": 1024,
           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


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


def test_mla_moe_estimate_within_15_percent(make_profile, tmp_path):
    m = measure_profile(_profile(make_profile, tmp_path, MLA_MOE, True))
    row = m.rows[0]
    assert row["predicted_bytes"] == pytest.approx(row["measured_bytes"], rel=0.15)


@pytest.mark.parametrize("adapter,checkpointing", [
    ({"kind": "bottleneck", "rank": 16}, False),
    ({"dtype": "fp32", "dropout": 0.1, "targets": "attention+mlp"}, True),
    ({"targets": ["o_proj", "down_proj"]}, False),
], ids=["bottleneck", "fp32-dropout", "late-modules"])
def test_adapter_variants_within_15_percent(make_profile, tmp_path, adapter, checkpointing):
    profile = _profile(make_profile, tmp_path, DENSE, checkpointing)
    profile.adapter = profile.adapter.model_copy(update=adapter)
    m = measure_profile(profile)
    assert m.rows[0]["predicted_bytes"] == pytest.approx(m.rows[0]["measured_bytes"], rel=0.15)


def test_cli_measure_prints_predicted_and_measured(repo, capsys):
    from orbitctl.cli.app import main

    assert main(["plan", str(repo / "profiles" / "tiny-cpu.yaml"), "--measure"]) == 0
    out = capsys.readouterr().out
    assert "--measure: 2-layer copy" in out and "activations+logits" in out and "calibrated" in out


def test_measured_states_match_the_plan(make_profile, tmp_path):
    m = measure_profile(_profile(make_profile, tmp_path, DENSE, True, targets="all-linear"))
    rows = {r["component"]: r for r in m.rows}
    assert rows["adapter_weights"]["measured_bytes"] == rows["adapter_weights"]["predicted_bytes"]
    assert rows["base_weights (bf16 copy)"]["measured_bytes"] == pytest.approx(
        rows["base_weights (bf16 copy)"]["predicted_bytes"], rel=0.01)
    assert m.calibrated_bytes["activations"] > 0 and m.activation_ratio > 0
