"""The checkpointed layer boundaries in host memory (``memory.offload_activations: cpu``).

With non-reentrant gradient checkpointing each decoder layer keeps only what it was called with
(its input hidden state) for the recompute in backward; everything inside the layer is
recomputed. :func:`offloaded_boundaries` moves exactly those saved inputs to host memory:

    with offloaded_boundaries(policy.model, enabled=True) as moved:
        loss = forward(...)      # each layer's saved input goes to the host as the layer starts
    loss.backward()              # each comes back to the device when its layer is recomputed
    moved.bytes                  # what went to the host in this forward

It wraps each checkpointed layer's checkpoint function for the duration of the forward and
enters :func:`torch.autograd.graph.saved_tensors_hooks` around that call alone: the checkpoint
saves its inputs under those hooks, while the tensors saved inside the layer fall under the
checkpoint's own (innermost) hooks, and the rest of the graph (final norm, output layer, loss)
under none. Parameters are saved by reference and never copied; neither is a tensor under
:data:`MIN_BYTES` (a mask, a position vector), where the copy would cost more than it frees.

On CUDA the copy goes into pinned host memory on a side stream, so it overlaps the layer's
compute; the device tensor is kept from reuse until the copy is done (``record_stream``). In
backward each boundary comes back on the side stream, and as one is handed to its layer's
recompute the copy of the next one backward needs starts, so it overlaps that layer's work: the
device holds two boundaries at a time, as the plan counts. A tensor already in host memory (the
CPU device) stays where it is: the hooks still run and count it, so the mechanism is the same
and measurable on every machine. A device without CUDA streams (a fake accelerator under
``FakeTensorMode``) is copied synchronously and holds one.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

MIN_BYTES = 16 * 2**10
"""Saved inputs smaller than this stay on the device."""

_SIDE_STREAMS: dict = {}


@dataclass
class Moved:
    """What one forward sent to the host."""

    bytes: int = 0
    tensors: int = 0
    _last: object = field(default=None, repr=False)
    """A weak reference to the last boundary packed: the graph alone keeps boundaries alive."""


def checkpointed_layers(model) -> list:
    """The layers that call their checkpoint function around their own forward: transformers' decoder
    layers (``GradientCheckpointingLayer``) once gradient checkpointing is on."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
            and callable(getattr(m, "_gradient_checkpointing_func", None))]


@contextmanager
def offloaded_boundaries(model, enabled: bool):
    """While active, the inputs each checkpointed layer of ``model`` saves for its recompute live in host memory.

    Yields a :class:`Moved` that counts them (nothing when ``enabled`` is false, when no layer is
    checkpointed, or in eval mode / under no_grad, where no layer checkpoints). Enter it around the
    train-path forward only; the backward may run after it has exited.
    """
    moved = Moved()
    layers = checkpointed_layers(model) if enabled else []
    originals = [layer._gradient_checkpointing_func for layer in layers]
    for layer, original in zip(layers, originals):
        layer._gradient_checkpointing_func = partial(_checkpoint_offloaded, original, moved)
    try:
        yield moved
    finally:
        for layer, original in zip(layers, originals):
            layer._gradient_checkpointing_func = original


def _checkpoint_offloaded(checkpoint, moved: Moved, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(partial(_pack, moved), _unpack):
        return checkpoint(*args, **kwargs)


class _Boundary:
    """One saved input on its way to the host and back.

    ``device_copy`` is set when the backward's copy back was started early (the prefetch), with
    ``ready`` the event the compute stream waits on before reading it; ``previous`` is a weak
    reference to the boundary packed before this one (the one backward needs next)."""

    __slots__ = ("host", "device", "ready", "device_copy", "previous", "__weakref__")

    def __init__(self, host, device, ready, previous):
        self.host, self.device, self.ready, self.previous = host, device, ready, previous
        self.device_copy = None


def _pack(moved: Moved, tensor: torch.Tensor):
    nbytes = tensor.numel() * tensor.element_size()
    if isinstance(tensor, torch.nn.Parameter) or nbytes < MIN_BYTES:
        return tensor
    moved.bytes += nbytes
    moved.tensors += 1
    previous = moved._last
    if tensor.device.type == "cpu":
        boundary = _Boundary(tensor, None, None, previous)
    elif tensor.device.type == "cuda" and torch.cuda.is_available():
        boundary = _Boundary(*_to_host_async(tensor), previous)
    else:
        boundary = _Boundary(tensor.to("cpu"), tensor.device, None, previous)
    moved._last = weakref.ref(boundary)
    return boundary


def _unpack(packed):
    if not isinstance(packed, _Boundary):
        return packed
    if packed.device is None:
        return packed.host
    if packed.ready is None:
        return packed.host.to(packed.device)
    tensor = packed.device_copy if packed.device_copy is not None else _to_device_async(packed)
    packed.device_copy = None
    torch.cuda.current_stream(packed.device).wait_event(packed.ready)
    # backward recomputes the layers last to first: start the copy back of the one it needs next
    previous = packed.previous() if packed.previous is not None else None
    if previous is not None and previous.device_copy is None:
        previous.device_copy = _to_device_async(previous)
    return tensor


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _to_host_async(tensor: torch.Tensor):
    """(pinned host copy, device, event): the copy runs on the side stream once ``tensor`` is computed."""
    compute, side = torch.cuda.current_stream(tensor.device), _side_stream(tensor.device)
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    # the forward drops its reference now; the allocator must not hand the memory out before the copy has read it
    tensor.record_stream(side)
    return host, tensor.device, done


def _to_device_async(packed: _Boundary) -> torch.Tensor:
    """The boundary back on its device, copied on the side stream; ``packed.ready`` is recorded after the copy.

    The destination is allocated from the compute stream (which frees it later), and the side stream
    waits for the compute stream first, so the memory is no longer in use by earlier work."""
    compute, side = torch.cuda.current_stream(packed.device), _side_stream(packed.device)
    tensor = torch.empty(packed.host.size(), dtype=packed.host.dtype, device=packed.device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        side.wait_event(packed.ready)  # the copy to the host has finished writing the pinned buffer
        tensor.copy_(packed.host, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    packed.ready = ready
    return tensor
