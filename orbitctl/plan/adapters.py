"""Which weights get adapters, and how many trainable parameters that makes.

Presets match the policy's module selection: ``attention``; ``attention+shared`` adds the
MLPs every token passes through (dense layers and shared experts); ``attention+mlp`` adds
the routed experts; ``all-linear`` adds the router too. lm_head is never adapted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orbitctl.arch.spec import ATTENTION, EXPERT, MLP, ROUTER, SHARED_EXPERT, ArchSpec, Weight
from orbitctl.errors import UserError

PRESETS = {
    "attention": (ATTENTION,),
    "attention+shared": (ATTENTION, MLP, SHARED_EXPERT),
    "attention+mlp": (ATTENTION, MLP, SHARED_EXPERT, EXPERT),
    "all-linear": (ATTENTION, MLP, SHARED_EXPERT, EXPERT, ROUTER),
}


EXPERT_LAYOUTS = ("none", "shared", "shared-outer", "per-expert")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_factor_shares(layout: str, projection: str) -> tuple[bool, bool]:
    """Whether A and B of a routed-expert ``projection`` are one matrix for all experts of a layer in ``layout``:
    ``shared`` shares both; ``shared-outer`` shares the factor on the hidden side (A of gate/up, B of down)."""
    if layout == "shared":
        return True, True
    if layout == "shared-outer":
        return projection != "down_proj", projection == "down_proj"
    if layout == "per-expert":
        return False, False
    raise ValueError(f"unknown expert-adapter layout {layout!r}; one of {', '.join(EXPERT_LAYOUTS[1:])}")


def expert_adapter_params(layout: str, num_experts: int, hidden: int, width: int, rank: int) -> int:
    """Trainable parameters of one MoE layer's routed-expert adapters (gate, up, down): per-expert
    3 E r (d + f), shared-outer 3 r (d + E f), shared 3 r (d + f)."""
    total = 0
    for projection in EXPERT_PROJECTIONS:
        d_in, d_out = (width, hidden) if projection == "down_proj" else (hidden, width)
        for size, shared in zip((rank * d_in, d_out * rank), expert_factor_shares(layout, projection)):
            total += size * (1 if shared else num_experts)
    return total


def expert_adapter_rank(adapter, hidden_size: int) -> int:
    """``adapter.experts_rank``; auto is the adapter's own rank."""
    return adapter_rank(adapter, hidden_size) if adapter.experts_rank == "auto" else int(adapter.experts_rank)


@dataclass(frozen=True)
class AdapterPlan:
    """The adapters a profile trains on an architecture: kind, rank, the adapted weights, their parameters."""

    kind: str
    rank: int
    trainable_params: int
    largest_layer_params: int
    """Adapter parameters of the layer with the most: the ZeRO-3 unit of gathered weights and grads."""
    persistent_params: int
    """Parameters in matrices below DeepSpeed's persistence threshold (10 x hidden): never partitioned."""
    adapted: frozenset[tuple[int, str]]
    """(layer index, weight name) of every adapted linear weight."""
    targets_routed_experts: bool
    """``adapter.targets`` selects the routed experts' own weights (``attention+mlp``, ``all-linear`` or their names):
    PEFT LoRA over the stacked experts, which builds every expert's bf16 weight. Not ``adapter.experts``."""
    expert_layout: str = "none"
    """``adapter.experts``: the routed experts' own adapters (computed on the routed tokens, never materialised)."""
    expert_rank: int = 0
    expert_params: int = 0
    """Trainable parameters of the routed-expert adapters, all MoE layers (included in ``trainable_params``)."""
    first_layer: int = 0
    """The lowest adapted decoder layer (``adapter.last_layers``): below it the update runs forward only."""

    def adapted_in(self, layer_index: int, name: str) -> bool:
        return (layer_index, name) in self.adapted


def routed_expert_adapters(ad: AdapterPlan, bytes_per_param: int) -> dict:
    """What the plan counts for the routed experts' adapters, as ``plan --json`` reports it (``details``):
    ``layout`` (``adapter.experts``: none, shared, shared-outer, per-expert), ``rank``, ``params`` (all MoE layers,
    included in ``params_trainable``), ``bytes`` (those parameters in the adapter dtype) and ``via_targets``
    (``adapter.targets`` also puts PEFT LoRA on the stacked experts)."""
    return {"layout": ad.expert_layout, "rank": ad.expert_rank, "params": ad.expert_params,
            "bytes": ad.expert_params * bytes_per_param, "via_targets": ad.targets_routed_experts}


def adapter_rank(adapter, hidden_size: int) -> int:
    return max(1, hidden_size // 10) if adapter.rank == "auto" else int(adapter.rank)


def _selected(arch: ArchSpec, targets) -> list[tuple[int, Weight]]:
    linear = list(arch.linear_weights())
    if isinstance(targets, str):
        kinds = PRESETS[targets]
        return [(i, w) for i, w in linear if w.kind in kinds]
    wanted = [str(t) for t in targets]
    chosen = [(i, w) for i, w in linear if any(w.name == t or w.name.endswith("." + t) or w.suffix == t for t in wanted)]
    missing = [t for t in wanted if not any(w.name == t or w.name.endswith("." + t) for _, w in linear)]
    if missing:
        names = sorted({w.suffix for _, w in linear})
        raise UserError(f"adapter.targets: no linear module named {', '.join(missing)} in {arch.name}",
                        fix=f"choose from {', '.join(names)}")
    return chosen


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a module name belongs to ('model.layers.12.mlp.up_proj' -> 12); None outside the layers."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def first_adapted_layer(num_layers: int, last_layers: int | None, model: str = "the model") -> int:
    """Index of the lowest decoder layer ``adapter.last_layers`` adapts of ``num_layers`` (0: every layer); more
    layers than ``model`` has is refused."""
    if last_layers is None:
        return 0
    if last_layers > num_layers:
        raise UserError(f"adapter.last_layers: {last_layers}, and {model} has {num_layers} decoder layers",
                        fix=f"set adapter.last_layers to at most {num_layers}, or remove it to adapt every layer")
    return num_layers - last_layers


def plan_adapters(arch: ArchSpec, adapter) -> AdapterPlan:
    rank = adapter_rank(adapter, arch.hidden_size)
    h = arch.hidden_size
    threshold = 10 * h  # stage3_param_persistence_threshold as the HF integration sets it
    first = first_adapted_layer(arch.num_layers, adapter.last_layers, arch.name)
    if adapter.kind == "bottleneck":
        # down [r, h] + bias [r], up [h, r] + bias [h], after every adapted layer's MLP
        matrices = [rank * h, rank, h * rank, h]
        per_layer = sum(matrices)
        layers = arch.num_layers - first
        persistent = sum(m for m in matrices if m < threshold) * layers
        return AdapterPlan("bottleneck", rank, per_layer * layers, per_layer, persistent,
                           frozenset(), False, first_layer=first)
    chosen = [(i, w) for i, w in _selected(arch, adapter.targets) if i >= first]
    if not chosen:
        raise UserError(f"adapter.targets: '{adapter.targets}' matches no linear weight of {arch.name}",
                        fix="name modules explicitly, e.g. [q_proj, v_proj]")
    total = persistent = 0
    per_layer: dict[int, int] = {}
    for index, w in chosen:
        out_f, in_f = w.shape
        a_size, b_size = rank * in_f * w.copies, out_f * rank * w.copies
        total += a_size + b_size
        per_layer[index] = per_layer.get(index, 0) + a_size + b_size
        persistent += sum(m for m in (a_size, b_size) if m < threshold)
    layout, expert_rank, expert_params = adapter.experts, 0, 0
    if layout != "none":
        moe = [layer.index for layer in arch.layers if layer.moe and layer.index >= first]
        if not moe:
            raise UserError(f"adapter.experts: {arch.name} has no routed experts", fix="set adapter.experts: none")
        expert_rank = expert_adapter_rank(adapter, h)
        layer = expert_adapter_params(layout, arch.num_experts, h, arch.moe_intermediate_size, expert_rank)
        expert_params = layer * len(moe)
        for i in moe:
            per_layer[i] = per_layer.get(i, 0) + layer
        total += expert_params
    return AdapterPlan("lora", rank, total, max(per_layer.values()), persistent,
                       frozenset((i, w.name) for i, w in chosen), any(w.kind == EXPERT for _, w in chosen),
                       layout, expert_rank, expert_params, first)
