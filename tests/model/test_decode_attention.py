"""The CPU's one-position decode attention and the KV cache with room: what the decode reads and computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orbitctl.kernels.decode_attention import DECODE_SDPA, attention, decode_attention, use_decode_attention
from orbitctl.kernels.kv_cache import RoomyKVCache, RoomyLayer, append_rows, new_kv_cache


def _qkv(batch=3, heads=4, kv_heads=2, length=9, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype)
    return q, k, v


def _reference(q, k, v, mask, scale):
    """float64 softmax(q k^T s + mask) v with the KV heads repeated for their query heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2.0 ** -20), (torch.bfloat16, 2.0 ** -6)])
def test_decode_attention_is_softmax_attention_over_the_unmasked_positions(dtype, tol):
    q, k, v = _qkv(dtype=dtype)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[2, ..., 7] = False  # a finished row's fed pad
    out = decode_attention(q, k, v, mask, 16 ** -0.5)
    assert out.dtype == dtype and out.shape == (3, 4, 1, 16)
    ref = _reference(q, k, v, mask, 16 ** -0.5)
    # bf16: the inputs are bf16 numbers, the sums float32, the output rounded once (and the exponentials once)
    assert bool(((out.double() - ref).abs() <= tol * (1 + ref.abs())).all())
    # what SDPA computes from the same inputs, to the dtype's rounding
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    assert bool(((out.double() - sdpa.double()).abs() <= 2 * tol * (1 + ref.abs())).all())
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    assert torch.equal(decode_attention(q, k, v, additive, 16 ** -0.5), out)
    closed = torch.zeros_like(mask)
    assert torch.equal(decode_attention(q, k, v, closed, 1.0), torch.zeros_like(out))  # nothing to attend: zeros


def test_only_a_plain_one_position_cpu_query_takes_the_written_out_path(monkeypatch):
    from transformers.integrations import sdpa_attention

    calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda *a, **kw: calls.append(a[1].shape[2]) or real(*a, **kw))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q, k, v = _qkv()
    with torch.no_grad():
        out, _ = attention(module, q, k, v, None, scaling=0.25)
    assert calls == [] and out.shape == (3, 1, 4, 16)  # [batch, positions, heads, dim], as transformers returns
    assert torch.equal(out, decode_attention(q, k, v, None, 0.25).transpose(1, 2))
    long_q = torch.randn(3, 4, 9, 16)
    attention(module, long_q, k, v, None, scaling=0.25)  # a prefill or the train path: SDPA
    attention(module, q.clone().requires_grad_(True), k, v, None, scaling=0.25)  # autograd: SDPA
    attention(module, q, k, v, None, dropout=0.1, scaling=0.25)
    assert calls == [9, 1, 1]
    assert use_decode_attention() == DECODE_SDPA


def test_the_cache_with_room_writes_each_step_in_place_and_takes_over_rows_reordered_elsewhere():
    layer = RoomyLayer(room=4)
    k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)
    buffer = layer.buffers[0]
    assert buffer.shape == (2, 3, 9, 8) and keys.data_ptr() == buffer.data_ptr()
    steps = [torch.randn(2, 3, 1, 8) for _ in range(5)]
    for step in steps[:4]:
        keys, _ = layer.update(step, step)
    assert layer.buffers[0] is buffer and layer.get_seq_length() == 9  # the room: no copy
    assert torch.equal(keys, torch.cat([k, *steps[:4]], dim=-2))
    keys, _ = layer.update(steps[4], steps[4])  # full: the buffer doubles
    assert layer.buffers[0].shape[-2] == 18 and torch.equal(keys, torch.cat([k, *steps], dim=-2))
    layer.batch_select_indices(torch.tensor([1]))  # transformers' own row selection replaces keys and values
    after = torch.randn(1, 3, 1, 8)
    keys, values = layer.update(after, after)
    assert torch.equal(keys, torch.cat([k[1:], *(s[1:] for s in steps), after], dim=-2))
    assert keys.data_ptr() == layer.buffers[0].data_ptr() and layer.buffers[0].shape[-2] == 11 + 4
    turn = torch.randn(1, 3, 6, 8)  # several positions past the buffer (an episode's next turn): them and the room
    keys, _ = layer.update(turn, turn)
    assert layer.buffers[0].shape[-2] == 17 + 4 and torch.equal(keys[..., 11:, :], turn)
    layer.reorder_cache(torch.tensor([0, 0]))  # rows reordered: copies, the old buffers let go
    assert layer.buffers is None and layer.keys.shape == (2, 3, 17, 8)
    keys, _ = layer.update(after.expand(2, -1, -1, -1), after.expand(2, -1, -1, -1))
    assert keys.shape[-2] == 18 and layer.buffers[0].shape[-2] == 18 + 4


def test_new_kv_cache_gives_room_to_full_attention_models_only():
    from transformers import LlamaConfig, MistralConfig

    llama = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    cache = new_kv_cache("bf16", llama, room=7)
    assert isinstance(cache, RoomyKVCache) and cache.room == 7
    sliding = MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                            sliding_window=16)
    assert new_kv_cache("bf16", sliding) is None  # its sliding layers keep transformers' own cache
    assert new_kv_cache("bf16") is None


def test_a_model_decodes_the_same_through_the_cache_with_room_and_the_written_out_attention():
    """The decode over the roomy cache and the CPU decode attention is the model's own decode (DynamicCache, SDPA)
    to the float32 rounding, appended rows (continuous batching) included."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=50, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 50, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def decode(attn: str, cache, steps: int = 5):
        model.config._attn_implementation = attn
        m = mask.clone()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=m, position_ids=positions, past_key_values=cache, use_cache=True)
            logits, pos = [out.logits[:, -1]], m.sum(-1, keepdim=True)
            for _ in range(steps):
                token = logits[-1].argmax(-1, keepdim=True)
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], -1)
                out = model(input_ids=token, attention_mask=m, position_ids=pos, past_key_values=out.past_key_values,
                            use_cache=True)
                logits.append(out.logits[:, -1])
                pos = pos + 1
        return torch.stack(logits, 1)

    theirs = decode("sdpa", DynamicCache())
    ours = decode(use_decode_attention(), RoomyKVCache(room=5))
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert bool(((ours - theirs).abs() <= 2.0 ** -16 * (1 + theirs.abs())).all())
    # rows appended to a running cache (continuous batching's admission) are taken over at the next update
    cache = RoomyKVCache(room=5)
    with torch.no_grad():
        model(input_ids=ids[:1], attention_mask=mask[:1], position_ids=positions[:1], past_key_values=cache)
        other = RoomyKVCache(room=5)
        model(input_ids=ids[1:], attention_mask=mask[1:], position_ids=positions[1:], past_key_values=other)
    append_rows(cache, other)
    step = torch.tensor([[7], [9]])
    m = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
    with torch.no_grad():
        out = model(input_ids=step, attention_mask=m, position_ids=mask.sum(-1, keepdim=True), past_key_values=cache)
        whole = model(input_ids=torch.cat([ids, step], -1), attention_mask=m,
                      position_ids=torch.cat([positions, mask.sum(-1, keepdim=True)], -1))
    assert all(layer.keys.data_ptr() == layer.buffers[0].data_ptr() for layer in cache.layers)
    assert bool(((out.logits[:, -1] - whole.logits[:, -1]).abs() <= 2.0 ** -16 * (1 + whole.logits[:, -1].abs())).all())
