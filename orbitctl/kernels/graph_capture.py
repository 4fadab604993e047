"""What a captured decode step needs that knows nothing of the model: the static-shape switch, which KV caches a
graph keeps, when graphs apply, and the masked-out key's bias.

    with static_shapes():              # layers that have a static-shape form take it (the expert-parallel exchange)
        ...
    static_shapes_active()             # asked by such a layer inside its forward

The decode step itself (:class:`~orbitctl.model.graph_decode.StaticDecode`: the static KV cache, the prepared
mask, the capture and the replays) lives with the model, which it runs.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_STATIC = contextvars.ContextVar("orbitctl_static_shapes", default=False)


@contextlib.contextmanager
def static_shapes():
    """Within it the model's layers take their static-shape forms (the expert-parallel exchange)."""
    token = _STATIC.set(True)
    try:
        yield
    finally:
        _STATIC.reset(token)


def static_shapes_active() -> bool:
    return _STATIC.get()


GRAPH_KV_DTYPES = ("bf16",)
"""KV-cache dtypes the static step keeps (the float8 cache grows its scales per step)."""


def graphs_apply(setting: bool | str, device_type: str, *, kv_dtype: str, keep_hidden: bool = False) -> bool:
    """Whether a decode runs on the static step with a captured graph: ``rollout.decode_graphs`` true or ``auto``,
    on a CUDA device, with a KV cache the static step keeps, and no per-step hidden states asked for."""
    return setting is not False and device_type == "cuda" and kv_dtype in GRAPH_KV_DTYPES and not keep_hidden


def closed_value(dtype: torch.dtype) -> float:
    """The additive bias of a masked-out key: the dtype's lowest finite value (exp of it minus any score is 0)."""
    return torch.finfo(dtype).min
