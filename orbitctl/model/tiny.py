"""Deterministic random-init tiny models in real Hugging Face format (config.json + safetensors).

    from orbitctl.model.tiny import build_tiny_model
    build_tiny_model("deepseek_v3", "artifacts/tiny-dsv3", max_shard_size="40KB")

Tests, demos and benchmarks build their models here instead of downloading one. Every
architecture has 2 layers and hidden size 64; every linear input dimension is a multiple of
64 (INT4 groups of 32 and 64 divide it) and every output dimension a multiple of 32 (the
bitsandbytes CPU kernel packs 32 rows at a time). The shapes follow the real families: GQA for
llama, 3-D stacked routed experts for qwen3_moe, MLA + shared expert + a dense first layer
for deepseek_v3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=256,
        q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        tie_word_embeddings=False, rope_scaling=None,
    ),
}

# Random init at the usual 0.02 gives near-uniform next-token distributions; a wider init gives
# peaked ones, so quantization error shows up in the logits the way it does on trained models.
TINY_INIT_RANGE = 0.08


def tiny_config(model_type: str, **overrides: Any):
    """The transformers config of a tiny model of this family (llama, qwen3_moe, deepseek_v3)."""
    from transformers import AutoConfig

    if model_type not in TINY_ARCHS:
        raise ValueError(f"no tiny model for '{model_type}'; known: {', '.join(sorted(TINY_ARCHS))}")
    values = {**TINY_ARCHS[model_type], "initializer_range": TINY_INIT_RANGE, **overrides}
    return AutoConfig.for_model(model_type, **values)


def build_tiny_model(
    model_type: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    dtype: str = "bfloat16",
    **overrides: Any,
) -> Path:
    """Write a deterministic random-init tiny model to ``out_dir`` and return the path.

    ``max_shard_size`` (e.g. ``"40KB"``) splits the safetensors into shards with an index;
    ``overrides`` replace config values (``num_hidden_layers=4``, ``vocab_size=512``, ...).
    The same seed and arguments give the same bytes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.do_sample = False
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return out


def build_tiny_char_model(out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random-init llama over the demo's character tokenizer (``tokenizer.json`` written beside it), as a
    checkpoint directory ``model.path`` can name: quantize, train, serve and export run on it end to end, with
    none of the demo's warm start. ``tie_word_embeddings=True`` gives the tied variant; the vocabulary and the
    special ids are the tokenizer's (pad 0, bos 1, eos 2)."""
    from orbitctl.model.charset import VOCAB_SIZE, save_char_tokenizer

    values = {"vocab_size": VOCAB_SIZE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    out = build_tiny_model("llama", out_dir, seed=seed, **values)
    save_char_tokenizer(out, int(values["vocab_size"]))
    return out
