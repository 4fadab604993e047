"""The decode step at static shapes, replayed from a CUDA graph on a GPU (``rollout.decode_graphs``).

    step = StaticDecode(model, cache_kw, prefilled_cache, mask, positions, max_new_tokens, capture=True)
    logits = step(token, alive)        # one generated token per row: a graph replay on a GPU, eager elsewhere

An eager decode step launches every op of the model from Python, one after the other: thousands of
kernels a token on a MoE model (a grouped expert layer alone is ~40), each a few microseconds of host
time while the GPU waits. A CUDA graph records the step's kernels once and replays them with one
call. What a graph needs is a step whose tensors keep their shapes and addresses and which never asks
the host for a value:

* the KV cache is preallocated at the batch's full length, prompt width + new tokens (transformers'
  ``StaticLayer``: the new position is written in place at a device-side counter), filled from the
  prefill's cache once;
* the attention mask is one ``[B, 1, 1, L]`` additive bias in the compute dtype, a column opened per
  step in place (left padding and finished rows stay closed), passed to the model as a prepared 4D
  mask so transformers builds none;
* the token and position inputs are buffers written in place;
* the routed experts run grouped (:mod:`~orbitctl.kernels.grouped_int4`, no ``.tolist()``) and, under
  expert parallelism, exchange tokens at static shapes (:meth:`ExpertParallelExperts.static_exchange`).

The first decode step runs eagerly on a side stream (it warms the allocator, compiles Triton kernels and
takes MLA's up-projection once); the second is captured; every later step is a replay. The step's result
is the same function as the eager decode over a growing cache: attention over the masked-out slots adds
exact zeros. Off a GPU the same static step runs eagerly, which is how its numerics are tested here.
"""

from __future__ import annotations

import contextlib

import torch

from orbitctl.kernels.graph_capture import closed_value, static_shapes
from orbitctl.model.router_replay import RouterTape


def _expert_group(model):
    """The :class:`~orbitctl.model.expert_parallel.ExpertGroup` of ``model``'s expert-parallel layers; None without
    expert parallelism (its ``group`` is None for the whole world)."""
    from orbitctl.model.expert_parallel import ExpertParallelExperts

    layer = next((m for m in model.modules() if isinstance(m, ExpertParallelExperts)), None)
    return None if layer is None or layer.ep.size == 1 else layer.ep


def same_batch_on_every_rank(model, batch: int, device: torch.device) -> bool:
    """Whether every rank of ``model``'s expert-parallel group decodes ``batch`` rows (True without expert
    parallelism); collective over that group, once per batch."""
    from orbitctl.dist.collectives import reduce_scalars

    ep = _expert_group(model)
    if ep is None:
        return True
    largest, negated_smallest = reduce_scalars([int(batch), -int(batch)], "max", ep.group)
    return largest == -negated_smallest


def every_rank_agrees(model, ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of ``model``'s expert-parallel group (``ok`` itself without expert
    parallelism); collective over that group. A graph capture that failed on one rank only must turn every rank's
    decode eager, or the ranks that replay would wait in collectives the eager one never joins."""
    from orbitctl.dist.collectives import reduce_scalars

    ep = _expert_group(model)
    if ep is None:
        return ok
    return bool(reduce_scalars([int(ok)], "min", ep.group)[0])


def sync_free(model) -> bool:
    """Whether ``model``'s forward can run without reading a value on the host: every routed-expert layer grouped
    (:class:`~orbitctl.kernels.grouped_int4.ExpertStack`, with adapters it computes); the per-expert loop reads the
    routing's counts."""
    from orbitctl.model.expert_lora import expert_layers
    from orbitctl.kernels.grouped_int4 import takes_lora

    return all(getattr(module, "stack", None) is not None
               and takes_lora(module.expert_lora.bound() if module.expert_lora is not None else None)
               for _, module in expert_layers(model))


class StaticDecode:
    """One batch's decode after its prefill, at static shapes (see the module docstring)."""

    def __init__(self, model, cache_kw: str, prefilled, mask: torch.Tensor, positions: torch.Tensor,
                 max_new_tokens: int, *, capture: bool, routing: RouterTape | None = None) -> None:
        from transformers.cache_utils import Cache, StaticLayer

        self.model, self.cache_kw, self.routing = model, cache_kw, routing
        batch, width = mask.shape
        self.static = same_batch_on_every_rank(model, batch, mask.device)
        """Whether the step runs at static shapes throughout: under expert parallelism only when every rank decodes
        as many rows (a rank's filler batch of one row keeps the all-to-all and eager steps, on every rank alike)."""
        self.capture = capture and self.static and sync_free(model)
        length = width + max_new_tokens
        self.cache = Cache(layers=[StaticLayer(max_cache_len=length) for _ in prefilled.layers])
        for static, grown in zip(self.cache.layers, prefilled.layers):
            static.lazy_initialization(grown.keys, grown.values)
            static.keys[:, :, :width].copy_(grown.keys)
            static.values[:, :, :width].copy_(grown.values)
            static.cumulative_length.fill_(width)
        dtype = self.cache.layers[0].keys.dtype
        self.bias = torch.full((batch, 1, 1, length), closed_value(dtype), dtype=dtype, device=mask.device)
        self.bias[:, 0, 0, :width].masked_fill_(mask.bool(), 0.0)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=mask.device)
        self.position = positions.clone()
        self.slot = self.first_slot = width
        """The cache slot the next fed token is written to (the layers' device-side counters agree)."""
        self.length = length
        self.graph = None
        self.logits = None
        self._routes: list[torch.Tensor] | None = None

    def _forward(self) -> torch.Tensor:
        with static_shapes() if self.static else contextlib.nullcontext():
            out = self.model(input_ids=self.token, attention_mask=self.bias, position_ids=self.position, use_cache=True,
                             **{self.cache_kw: self.cache})
        return out.logits[:, -1, :]

    def __call__(self, token: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Feed ``token`` [B] (a row not ``alive`` feeds padding its later steps never attend to); returns the next
        logits [B, vocab]. The tensor returned is overwritten by the next call on a GPU: read it first."""
        if self.slot >= self.length:
            raise RuntimeError(f"the static decode holds {self.length} positions and all are written")
        self.token.copy_(token[:, None])
        self.bias[:, 0, 0, self.slot].masked_fill_(alive.bool(), 0.0)
        if not self.capture:
            logits = self._forward()
        elif self.graph is not None:
            self.graph.replay()
            logits = self.logits
            self._record_replayed()
        elif self.logits is None:  # the warm-up step: eager, on a side stream, as capture wants
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.logits = logits
        else:
            logits = self._capture_and_replay()
        self.position.add_(1)
        self.slot += 1
        return logits

    def _capture_and_replay(self) -> torch.Tensor:
        """Capture the step (recorded, not run) and replay it once; where capture fails, warn and decode this batch
        eagerly on the same static step."""
        import warnings

        recording = self.routing is not None and self.routing.mode == "record"
        graph = torch.cuda.CUDAGraph()
        failure = None
        try:
            with torch.cuda.graph(graph):
                logits = self._forward()
        except RuntimeError as exc:
            failure = f"CUDA graph capture of the decode step failed ({str(exc).splitlines()[0]})"
        # a capture records the collectives without running them; whether every rank captured is agreed eagerly
        if not every_rank_agrees(self.model, failure is None, self.position.device):
            warnings.warn(f"{failure or 'another expert-parallel rank failed to capture the decode step'}; this batch "
                          "decodes eagerly (set rollout.decode_graphs: false to skip the attempt)", RuntimeWarning)
            if recording:  # what the capture's hooks appended: each layer keeps the steps that ran
                self.routing.truncate(self.slot - self.first_slot)
            self.capture = False
            return self._forward()
        self.graph, self.logits = graph, logits
        if recording:
            self._routes = self.routing.pop_last()  # the routing tensors the graph rewrites at each replay
        self.graph.replay()
        self._record_replayed()
        return self.logits

    def _record_replayed(self) -> None:
        if self._routes is not None:
            self.routing.append([indices.clone() for indices in self._routes])
