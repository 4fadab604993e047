"""Where the frozen base lives on each rank: routed experts by expert parallelism, the dense rest by dense_layout.

``memory.expert_parallel: P`` splits the ranks into groups of P; rank r of a group holds
routed experts [r E/P, (r+1) E/P) of every MoE layer in their stored format, outside ZeRO's
partitioning, so they are never gathered. ``memory.dense_layout`` (resolved: ``replicated``
under zero_stage <= 2, ``sharded`` under 3) keeps the dense part (attention, shared
experts, dense layers, embeddings, lm_head, norms, router) whole on every rank, or
ZeRO-3-partitioned over all ranks and gathered layer by layer. With P = 1 the routed experts
follow the dense layout: a sharded MoE layer is gathered with all its experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orbitctl.plan.storage import BaseStorage


@dataclass(frozen=True)
class Layout:
    """A profile's placement of the frozen base, and what each rank holds of it."""

    expert_parallel: int
    dense: str
    """'replicated' or 'sharded' (``MemorySection.resolved_dense_layout``)."""
    world: int
    num_experts: int
    offload_params: bool
    """ZeRO-Infinity: the ZeRO-3 partitions live in host RAM (expert-parallel experts and bnb's absmax, which
    are not partitioned parameters, stay on the GPU)."""

    @property
    def expert_parallel_on(self) -> bool:
        return self.expert_parallel > 1 and self.num_experts > 0

    @property
    def sharded(self) -> bool:
        return self.dense == "sharded"

    @property
    def experts_per_rank(self) -> int:
        """Routed experts of one MoE layer a rank holds (all E unless expert-parallel or ZeRO-3-sharded)."""
        return math.ceil(self.num_experts / self.expert_parallel) if self.expert_parallel_on else self.num_experts

    @property
    def expert_share(self) -> float:
        """Fraction of the routed experts an expert-parallel rank owns: ceil(E/P) / E (exactly 1/P when P divides E)."""
        return self.experts_per_rank / self.num_experts if self.expert_parallel_on else 1.0

    @property
    def name(self) -> str:
        """'EP 8, dense replicated' for a MoE model, 'base sharded' for a dense one."""
        if not self.num_experts:
            return f"base {self.dense}"
        return f"EP {self.expert_parallel if self.expert_parallel_on else 1}, dense {self.dense}"


def layout_of(profile, num_experts: int) -> Layout:
    mem = profile.memory
    return Layout(expert_parallel=mem.expert_parallel, dense=mem.resolved_dense_layout, world=profile.world_size,
                  num_experts=num_experts, offload_params=mem.offload_params == "cpu")


def resident_base(storage: BaseStorage, layout: Layout) -> dict[str, float]:
    """GPU bytes per rank of the frozen base: ``base_weights`` (the dense part), ``routed_experts``
    (P > 1: the rank's own ceil(E/P) experts of every MoE layer; P = 1: the experts' ZeRO-3 shard,
    or all of them when replicated) and ``quant_state_replicated`` (bnb absmax, which no ZeRO stage
    partitions or offloads: whole on every rank, the experts' part divided by P under expert parallelism)."""
    shard = layout.world if layout.sharded else 1
    offloaded = layout.offload_params  # ZeRO-Infinity moves the ZeRO-3 partitions (parameters only) to host
    dense = storage.dense_sharded_bytes / shard + storage.dense_unshardable_bytes
    dense_meta = storage.dense_replicated_bytes
    expert_data = storage.expert_sharded_bytes + storage.expert_unshardable_bytes
    if layout.expert_parallel_on:  # outside ZeRO: never partitioned, never offloaded
        experts = expert_data * layout.expert_share
        expert_meta = storage.expert_replicated_bytes * layout.expert_share
    else:
        experts = 0.0 if offloaded else storage.expert_sharded_bytes / shard + storage.expert_unshardable_bytes
        expert_meta = storage.expert_replicated_bytes
    return {"base_weights": 0.0 if offloaded else dense,
            "routed_experts": experts,
            "quant_state_replicated": dense_meta + expert_meta}


def host_base(storage: BaseStorage, layout: Layout, gpus_per_node: int, nodes: int) -> float:
    """Host RAM per node of ``offload_params: cpu``: the ZeRO-3 partitions (bnb's absmax is no parameter and
    stays on the GPU, ``quant_state_replicated``)."""
    if not layout.offload_params:
        return 0.0
    if layout.expert_parallel_on:
        sharded = storage.dense_sharded_bytes + storage.dense_unshardable_bytes
    else:
        sharded = storage.sharded_bytes + storage.unshardable_bytes
    return sharded / nodes


def gather_units(storage: BaseStorage, layout: Layout) -> list[float]:
    """ZeRO-3's gather units in execution order (embedding, layer 0 .. L-1, lm_head), each in its stored
    format; a MoE layer without its routed experts under expert parallelism. Empty when nothing is sharded."""
    if not layout.sharded:
        return []
    ep = layout.expert_parallel_on
    layers = [total - experts if ep else total for total, experts in zip(storage.layer_bytes, storage.layer_expert_bytes)]
    return [storage.embedding_bytes, *layers, storage.lm_head_bytes]


def gather_window(units: list[float], prefetch_layers: int) -> float:
    """The largest sum of (1 + prefetch) consecutive units: what is gathered at once (current + prefetch)."""
    if not units:
        return 0.0
    window = 1 + prefetch_layers
    return max(sum(units[i:i + window]) for i in range(len(units)))


def owned_experts(ep_rank: int, ep_size: int, num_experts: int) -> range:
    """The global indices of the routed experts that rank ``ep_rank`` of an expert-parallel group of ``ep_size``
    holds: ``[r E/P, (r+1) E/P)`` (P must divide E; the caller refuses otherwise)."""
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def widest_expert_parallel(num_experts: int, gpus_per_node: int) -> int:
    """The largest P that divides the node's GPUs and the routed experts: expert groups stay on one node's links."""
    if num_experts <= 0:
        return 1
    return max(d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and num_experts % d == 0)
