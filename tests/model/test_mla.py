"""MLA decode on the cached latent (orbitctl.model.mla): the same function as transformers' re-expanding decode and
as the train path's full-sequence forward, with an adapter on kv_b_proj, left padding, each attention kernel."""

from __future__ import annotations

import pytest
import torch

from orbitctl.model.frozen_base import load_frozen_base
from orbitctl.model.mla import is_mla_attention

FP32_EPS = torch.finfo(torch.float32).eps


def _decode_logits(model, ids, mask, prompt: int):
    """The prompt's last logits, then each later position's, decoded one token at a time through a dynamic cache."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        step = model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=positions[:, :prompt],
                     past_key_values=cache, use_cache=True)
        out.append(step.logits[:, -1])
        for t in range(prompt, ids.shape[1]):
            step = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                         past_key_values=cache, use_cache=True)
            out.append(step.logits[:, -1])
    return torch.stack(out, 1), cache


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_absorbed_decode_is_the_expanded_decode_and_the_full_forward(int4_moe, attention):
    """Left-padded rows, a LoRA on kv_b_proj with non-zero B (the identity pass must carry it): the absorbed decode
    against the re-expanding decode (the same model with the absorption switched off) and against one full-sequence
    forward (the train path), within the float32 rounding of sums over the hidden width."""
    from peft import LoraConfig, get_peft_model

    model = load_frozen_base(int4_moe, compute_dtype=torch.float32, attention=attention)
    layers = [m for m in model.modules() if is_mla_attention(m)]
    assert layers and all(type(m).__name__.startswith("Absorbed") for m in layers)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["kv_b_proj"]))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.5
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (5, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :4] = 0  # two left-padded rows
    absorbed, cache = _decode_logits(model, ids, mask, 8)
    # the latent path ran: it took kv_b_proj's weight once per layer for this cache
    assert sorted(layer for layer, _ in cache._orbitctl_mla_up) == [m.layer_idx for m in layers]
    for m in layers:  # back to transformers' own class: the latent re-expanded every step
        m.__class__ = type(m).__mro__[2]
    expanded, cache = _decode_logits(model, ids, mask, 8)
    assert not hasattr(cache, "_orbitctl_mla_up")
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 7:]
    scale = full.abs().max()
    bound = 64 * FP32_EPS * scale  # a few ulps of the largest logit, summed over layers
    assert (absorbed - expanded).abs().max() <= bound
    assert (absorbed - full).abs().max() <= bound
    assert (expanded - full).abs().max() <= bound


def test_a_dense_model_keeps_its_attention():
    """Only MLA layers change class: a llama's attention is untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from orbitctl.model.mla import use_absorbed_mla

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=50))
    assert use_absorbed_mla(model) == 0
