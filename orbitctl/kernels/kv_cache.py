"""The infer path's KV cache in float8 (``rollout.kv_dtype: fp8``), as a transformers ``Cache``.

Each attention layer calls ``cache.update(key_states, value_states, layer_idx)`` with the new
positions' K and V, ``[batch, kv_heads, new_positions, head_dim]``, and attends over what it returns.
:class:`Fp8KVLayer` stores what it is given in ``torch.float8_e4m3fn`` (1 byte per element) plus one
float32 scale per (row, KV head, position) and returns the whole history dequantized to the
compute dtype: attention reads only rounded K/V, the prompt's own positions included (the prefill
too attends over the stored cache, as an engine with an fp8 cache does).

Why one scale per token and KV head:

* e4m3 keeps 3 mantissa bits over a range of +-448, so a group is stored as ``x / s`` with
  ``s = amax / 448`` and every element keeps a relative error of at most ``2^-4`` (half a step of
  the 3-bit mantissa), down to the subnormals (``2^-9`` steps below ``2^-6``, i.e. an absolute error
  of at most ``2^-10 * s``).
* A token's scale is fixed when it is written, so appending never rescales (or clips) what is
  already stored; a per-tensor scale frozen at the prefill (transformers' ``Fp8QuantizedLayer``)
  would clip a later token that outgrows it, and one re-fitted per step would re-round the history.
* Heads differ in magnitude (RoPE'd key heads carry outlier channels in some heads only), so one
  scale per head keeps a quiet head's resolution; a finer split of ``head_dim`` buys little more
  and costs a scale per block.

The scales cost ``4 / head_dim`` bytes per element (3% at head_dim 128; 25% on the tiny demo's
head_dim 16).

MLA (DeepSeek-V3 / Kimi-K2): transformers' ``deepseek_v3`` attention calls ``update`` with the
compressed latent (``kv_nope``, the normed ``kv_lora_rank`` latent, as the "key") and the shared
RoPE key (``k_rot``, ``qk_rope_head_dim``, as the "value"), each as one head, and expands them to
per-head K and V (``kv_b_proj``) after reading the cache. So with MLA the latent is what is stored
in fp8: ``kv_lora_rank + qk_rope_head_dim`` bytes per token and layer (what ``orbitctl plan``
counts for fp8 KV), with one scale for each of the two parts (8 bytes more, 1.4% at Kimi-K2's 576); the plan counts the
payload and the scales (``ArchSpec.kv_bytes_per_token_layer``).

``bf16`` (the schema's other value) keeps K and V in the compute dtype. Where every attention layer of the
model attends over its whole history (no sliding windows), :class:`RoomyKVCache` keeps each layer's K and V in
buffers with room for the decode's new positions, written in place; transformers' ``DynamicCache``
concatenates each step's K and V onto a fresh copy of the whole history instead, which at the representative
setting's decode (32 rows, 12 heads, up to 109 positions) cost 16% of the rollout. Other models keep their own
cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV_DTYPES = ("bf16", "fp8", "fp8_e5m2")
"""What :func:`new_kv_cache` builds: ``bf16`` the model's own cache in the compute dtype; ``fp8`` float8
e4m3 (``rollout.kv_dtype: fp8``); ``fp8_e5m2`` float8 e5m2 (2 mantissa bits: a coarser cache the tests
measure e4m3 against)."""
_FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def new_kv_cache(kv_dtype: str, config=None, room: int = 0) -> "Fp8KVCache | RoomyKVCache | None":
    """A fresh cache for one prefill and its decode: an :class:`Fp8KVCache` in a float8 format; for ``bf16`` a
    :class:`RoomyKVCache` with ``room`` positions beyond the prefill where the model's ``config`` has only
    full-attention layers, else None (the model then makes its own)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV-cache dtype {kv_dtype!r}; one of {', '.join(KV_DTYPES)}")
    if kv_dtype != "bf16":
        return Fp8KVCache(_FP8_FORMATS[kv_dtype])
    return RoomyKVCache(room) if config is not None and _full_attention_only(config) else None


def _full_attention_only(config) -> bool:
    """Whether every layer of ``config``'s decoder caches as transformers' plain ``DynamicLayer`` (full attention)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):
        return False
    return bool(types) and all(t == "full_attention" for t in types)


def _view_of(view: torch.Tensor | None, buffer: torch.Tensor) -> bool:
    """Whether ``view`` is ``buffer``'s first positions (same rows, heads and width)."""
    return (view is not None and view.dim() == buffer.dim() and view.data_ptr() == buffer.data_ptr()
            and view.shape[:-2] == buffer.shape[:-2] and view.shape[-1] == buffer.shape[-1])


class RoomyLayer(DynamicLayer):
    """One full-attention layer's K and V in buffers ``[batch, heads, capacity, head_dim]`` of which ``keys`` and
    ``values`` are views of the filled positions: an update writes its positions in place and returns the views.

    Anything that replaces ``keys`` / ``values`` with other tensors (transformers' row selection, :func:`append_rows`)
    is taken over at the next update: copied into new buffers with ``room`` positions to spare; a row reordering lets
    the old buffers go at once. A buffer that a decode step finds full doubles; one that several new positions (the
    next turn of an episode) overflow grows to them and ``room`` more."""

    def __init__(self, room: int = 0):
        super().__init__()
        self.room = room
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        held = self.buffers
        if held is None or not (_view_of(self.keys, held[0]) and _view_of(self.values, held[1])) \
                or end > held[0].shape[-2] or held[0].shape[0] != key_states.shape[0]:
            capacity = end + self.room
            if held is not None and _view_of(self.keys, held[0]) and end > held[0].shape[-2] \
                    and key_states.shape[-2] == 1:
                capacity = max(capacity, 2 * held[0].shape[-2])
            held = self.buffers = tuple(self._grown(old, new, length, capacity)
                                        for old, new in ((self.keys, key_states), (self.values, value_states)))
        keys, values = held
        keys[..., length:end, :].copy_(key_states)
        values[..., length:end, :].copy_(value_states)
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    @staticmethod
    def _grown(old: torch.Tensor, new: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        buffer = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
        if length:
            buffer[..., :length, :].copy_(old)
        return buffer

    def reorder_cache(self, beam_idx) -> None:
        """The rows taken, as copies of the filled positions; the buffers they were read from are let go now, not at
        the next update (a cache continued for fewer rows holds one copy, not two)."""
        super().reorder_cache(beam_idx)
        self.buffers = None

    def reset(self) -> None:
        self.buffers = None
        super().reset()


class RoomyKVCache(Cache):
    """A cache of :class:`RoomyLayer`, one per attention layer, added as the model first calls it."""

    def __init__(self, room: int = 0):
        self.room = room
        super().__init__(layer_class_to_replicate=lambda: RoomyLayer(room))


def quantize_groups(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` in float8 with one float32 scale per last-dimension group: ``(payload, scale [..., 1])``,
    ``scale = amax / fmax`` (fmax: 448 for e4m3, 57344 for e5m2).

    Numerics: ``x`` in any float dtype, divided by its group's float32 scale in float32, rounded once to the float8
    format (relative error at most half its mantissa step: ``2^-4`` for e4m3). Groups independent: a token's
    (row, head) scale is fixed when written. :func:`dequantize_groups` is the inverse, ``payload x scale`` in float32
    rounded to the compute dtype."""
    fmax = torch.finfo(fp8_dtype).max
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    # an all-zero group keeps a positive scale (its payload is 0 either way)
    scale = (amax / fmax).clamp(min=torch.finfo(torch.float32).tiny)
    payload = (x.float() / scale).clamp(-fmax, fmax).to(fp8_dtype)
    return payload, scale


def dequantize_groups(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize_groups`, in ``dtype``."""
    return (payload.float() * scale).to(dtype)


class Fp8KVLayer(DynamicLayer):
    """One attention layer's K and V in float8 with a float32 scale per (row, head, position).

    ``keys`` / ``values`` hold the float8 payloads ``[batch, heads, positions, head_dim]`` (so the
    sequence length and the mask sizes are read as for any dynamic layer); ``key_scales`` /
    ``value_scales`` ``[batch, heads, positions, 1]``; ``dtype`` is the compute dtype they are
    dequantized to.
    """

    is_croppable = False

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
        super().__init__()
        self.fp8_dtype = fp8_dtype
        self.key_scales = self.value_scales = None
        self.dtype = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_keys, new_key_scales = quantize_groups(key_states, self.fp8_dtype)
        new_values, new_value_scales = quantize_groups(value_states, self.fp8_dtype)
        if self.keys is None:
            self.keys, self.key_scales = new_keys, new_key_scales
            self.values, self.value_scales = new_values, new_value_scales
        else:
            self.keys = torch.cat([self.keys, new_keys], dim=-2)
            self.key_scales = torch.cat([self.key_scales, new_key_scales], dim=-2)
            self.values = torch.cat([self.values, new_values], dim=-2)
            self.value_scales = torch.cat([self.value_scales, new_value_scales], dim=-2)
        return (dequantize_groups(self.keys, self.key_scales, self.dtype),
                dequantize_groups(self.values, self.value_scales, self.dtype))

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def stored_bytes(self) -> tuple[int, int]:
        """(payload bytes, scale bytes) this layer holds."""
        if self.keys is None:
            return 0, 0
        payload = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        scales = sum(t.numel() * t.element_size() for t in (self.key_scales, self.value_scales))
        return payload, scales

    def _apply(self, fn) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
            self.key_scales, self.value_scales = fn(self.key_scales), fn(self.value_scales)

    def reset(self) -> None:
        self.keys = self.values = self.key_scales = self.value_scales = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the fp8 KV cache is not croppable")

    def offload(self):
        self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.keys is not None and self.keys.device != self.device:
            self._apply(lambda t: t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._apply(lambda t: t[indices, ...])


class Fp8KVCache(Cache):
    """A dynamic cache of :class:`Fp8KVLayer`, one per attention layer, added as the model first calls it."""

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
        self.fp8_dtype = fp8_dtype
        super().__init__(layer_class_to_replicate=lambda: Fp8KVLayer(fp8_dtype))

    def stored_bytes(self) -> tuple[int, int]:
        """(float8 payload bytes, float32 scale bytes) over every layer."""
        totals = [layer.stored_bytes() for layer in self.layers]
        return sum(p for p, _ in totals), sum(s for _, s in totals)


_ROW_TENSORS = ("keys", "values", "key_scales", "value_scales")
"""A cache layer's tensors with a row (batch) dimension first and a position dimension second to last."""


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - t.shape[-2]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros((*t.shape[:-2], missing, t.shape[-1])), t], dim=-2)


def append_rows(cache: Cache, other: Cache) -> None:
    """Append ``other``'s rows to ``cache``, layer by layer (two caches of one model, either kind this module makes):
    the shorter one's positions left-padded with zeros to the longer's length, positions its attention mask must
    keep closed (:meth:`~orbitctl.model.policy.Policy.sample_stream` admits a prefilled row into a running batch so)."""
    for mine, theirs in zip(cache.layers, other.layers):
        for name in _ROW_TENSORS:
            a, b = getattr(mine, name, None), getattr(theirs, name, None)
            if a is None or b is None:
                continue
            length = max(a.shape[-2], b.shape[-2])
            setattr(mine, name, torch.cat([_left_pad(a, length), _left_pad(b, length)], dim=0))
