"""Adapter targets on a tied-embedding llama: every preset leaves the output layer (the embedding) alone, and
naming it is refused with the reason."""

import pytest
import torch

from orbitctl.errors import UserError


@pytest.fixture(scope="module")
def tied_llama():
    from transformers import AutoModelForCausalLM

    from orbitctl.model.tiny import tiny_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=True))


@pytest.mark.parametrize("preset", ["all-linear", "attention", "attention+mlp", "attention+shared"])
def test_no_preset_targets_the_tied_output_layer(tied_llama, preset):
    from orbitctl.model.adapters import resolve_targets

    assert tied_llama.lm_head.weight is tied_llama.model.embed_tokens.weight
    chosen = resolve_targets(tied_llama, preset)
    assert chosen and not any(n.endswith("lm_head") or "embed" in n for n in chosen)


def test_naming_lm_head_is_refused_with_the_reason(tied_llama):
    from orbitctl.model.adapters import resolve_targets

    with pytest.raises(UserError, match="adapter.targets: lm_head: the output layer is never adapted"):
        resolve_targets(tied_llama, ["q_proj", "lm_head"])
    assert resolve_targets(tied_llama, ["q_proj"]) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
