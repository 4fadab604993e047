"""Parameter counts: ArchSpec against real transformers modules and the published anchors."""

from __future__ import annotations

import pytest

from orbitctl.arch import arch_from_config, builtin_arch, builtin_names
from orbitctl.errors import UserError

# small variants of every supported model type, exercising each optional structure
SMALL = {
    "llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, attention_bias=True, mlp_bias=True),
    "llama_tied": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=100, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=100),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, vocab_size=100),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, vocab_size=100, mlp_only_layers=[0], decoder_sparse_step=1),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=100),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                        topk_group=1, vocab_size=100, num_nextn_predict_layers=1),
    # DeepSeek-V3 without a query LoRA (q_proj straight from hidden): the Lite layout
    "deepseek_v3_noqlora": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                                topk_group=1, vocab_size=100),
    # Kimi-K2's field names and layout (1 dense layer, 1 shared expert), built through deepseek_v3
    "kimi_k2": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=3,
                    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=12,
                    n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=1,
                    topk_group=1, vocab_size=96, num_nextn_predict_layers=0, routed_scaling_factor=2.827),
}


def _real_numel(model_type: str, fields: dict) -> int:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_type = {"llama_tied": "llama", "deepseek_v3_noqlora": "deepseek_v3", "kimi_k2": "deepseek_v3"}.get(
        model_type, model_type)
    config = AutoConfig.for_model(hf_type, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("variant", sorted(SMALL))
def test_count_equals_transformers_numel(variant):
    fields = dict(SMALL[variant])
    model_type = {"llama_tied": "llama", "deepseek_v3_noqlora": "deepseek_v3"}.get(variant, variant)
    spec = arch_from_config({"model_type": model_type, **fields})
    assert spec.params_total == _real_numel(variant, fields)


def test_kimi_k2_model_type_parses_like_deepseek_v3():
    fields = dict(SMALL["kimi_k2"])
    as_kimi = arch_from_config({"model_type": "kimi_k2", **fields})
    as_dsv3 = arch_from_config({"model_type": "deepseek_v3", **fields})
    assert as_kimi.params_total == as_dsv3.params_total
    assert as_kimi.attention == "mla" and as_kimi.moe_layers == 2


# (catalog name, total, active or None, relative tolerance) from the published model cards
ANCHORS = [
    ("kimi-k2", 1.04e12, 32e9, 0.04),
    ("deepseek-v3", 671e9, 37e9, 0.02),
    ("llama-3.1-8b", 8.03e9, None, 0.002),
    ("llama-3.1-70b", 70.6e9, None, 0.002),
    ("llama-3.1-405b", 405.9e9, None, 0.002),
    ("qwen3-235b-a22b", 235e9, 22e9, 0.01),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.005),
    ("qwen2.5-7b", 7.61e9, None, 0.005),
]


@pytest.mark.parametrize("name,total,active,tol", ANCHORS)
def test_published_anchors(name, total, active, tol):
    spec = builtin_arch(name)
    assert spec.params_total == pytest.approx(total, rel=tol)
    if active is not None:
        assert spec.params_active == pytest.approx(active, rel=max(tol, 0.03))
    else:
        assert spec.params_active == spec.params_total


def test_kimi_k2_breakdown_matches_reference_arithmetic():
    spec = builtin_arch("kimi-k2")
    assert spec.params_total / 1e9 == pytest.approx(1026.4, abs=0.1)
    assert spec.params_by_kind["expert"] / 1e9 == pytest.approx(1014.7, abs=0.1)
    assert spec.largest_layer_params / 1e9 == pytest.approx(17.0, abs=0.1)
    assert spec.kv_elements_per_token_layer() * 2 * spec.num_layers == 70_272


def test_mtp_layers_are_reported_not_counted():
    spec = builtin_arch("deepseek-v3")
    assert spec.mtp_layers == 1
    # the checkpoint's 685 B = 671 B main model + ~14 B next-token-prediction module
    assert (spec.params_total + spec.mtp_params) / 1e9 == pytest.approx(685, abs=1.5)


def test_every_catalog_entry_parses():
    for name in builtin_names():
        spec = builtin_arch(name)
        assert spec.params_total > 0 and len(spec.layers) == spec.num_layers


def test_tiny_llama_is_the_demo_contract():
    from orbitctl.arch.catalog import builtin_config

    cfg = builtin_config("tiny-llama")
    assert (cfg["vocab_size"], cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (100, 0, 1, 2)
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64 and cfg["tie_word_embeddings"] is False


def test_unsupported_model_type_names_the_key():
    with pytest.raises(UserError, match="model_type: 'gpt2' is not supported"):
        arch_from_config({"model_type": "gpt2", "hidden_size": 8})


def test_missing_field_names_the_key():
    with pytest.raises(UserError, match="num_hidden_layers"):
        arch_from_config({"model_type": "llama", "hidden_size": 64, "vocab_size": 10, "num_attention_heads": 4,
                          "intermediate_size": 8})
