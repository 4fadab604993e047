"""LoRA on the routed experts of a frozen INT4/FP8 MoE: computed on the routed tokens, never materialised.

For expert ``e`` and projection ``p`` (gate and up: hidden ``d`` -> expert width ``f``; down: ``f`` -> ``d``)

    y = Q_p,e(x) + s * (x A_p,e^T) B_p,e^T          s = alpha / r

on the tokens routed to ``e`` only: the quantized weight is dequantized as without adapters, and
the adapter costs two thin matmuls through the rank ``r``. ``W + B A`` is never formed, nor any
``[E, out, in]`` delta. Three layouts (``adapter.experts``):

=============  ====================================  ====================================  ======================
layout         gate / up                             down                                  parameters per layer
=============  ====================================  ====================================  ======================
per-expert     A [E, r, d], B [E, f, r]              A [E, r, f], B [E, d, r]              3 E r (d + f)
shared-outer   A [r, d] shared, B [E, f, r]          A [E, r, f], B [d, r] shared          3 r (d + E f)
shared         A [r, d], B [f, r]                    A [r, f], B [d, r]                    3 r (d + f)
=============  ====================================  ====================================  ======================

``shared-outer`` shares the factor on the model's side (the hidden dimension) and keeps the one on
the expert's side per expert (the Tinker cookbook's and miles' default); ``shared`` is one adapter
for all experts (Megatron-Bridge's). Under expert parallelism every rank keeps every expert's
factors (replicated like any adapter) and computes with those of the experts it holds: the others
get zero gradients on that rank, so the data-parallel average over the ranks is each owner's
gradient (the loss is divided by the step's tokens over all ranks), and the factors start from the
same draws as in one process holding every expert.

Saved in the PEFT names vLLM's MoE LoRA loader reads, one pair per expert and projection
(``...mlp.experts.{e}.gate_proj.lora_A.weight`` [r, in], ``.lora_B.weight`` [out, r]); a shared
factor is written once per expert (the same values), and reading it back checks they agree.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from orbitctl.plan.adapters import EXPERT_LAYOUTS, EXPERT_PROJECTIONS, expert_factor_shares as shares, layer_index

LAYOUTS = EXPERT_LAYOUTS
PROJECTIONS = EXPERT_PROJECTIONS


class ExpertLoRA(nn.Module):
    """The adapter factors of one MoE layer's routed experts (``experts``: their global indices)."""

    def __init__(self, layout: str, experts: range | list[int], hidden: int, width: int, rank: int, alpha: float,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.layout, self.rank, self.alpha, self.scale = layout, rank, alpha, alpha / rank
        self.experts = list(experts)
        self._slot = {e: i for i, e in enumerate(self.experts)}
        self.hidden, self.width = hidden, width
        self.enabled = True
        for projection in PROJECTIONS:
            d_in, d_out = (width, hidden) if projection == "down_proj" else (hidden, width)
            shared_a, shared_b = shares(layout, projection)
            lead_a = () if shared_a else (len(self.experts),)
            lead_b = () if shared_b else (len(self.experts),)
            a = torch.empty(lead_a + (rank, d_in), dtype=torch.float32)
            # PEFT's LoRA init: A ~ kaiming-uniform(a=sqrt(5)) per [r, in] matrix, B = 0 (the adapted model
            # starts equal to the base); drawn in fp32 on the CPU, the same numbers for one seed anywhere
            for matrix in a.view(-1, rank, d_in):
                nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
            self.register_parameter(_name(projection, "A"), nn.Parameter(a.to(device=device, dtype=dtype)))
            self.register_parameter(_name(projection, "B"), nn.Parameter(
                torch.zeros(lead_b + (d_out, rank), dtype=dtype, device=device)))

    def factors(self, projection: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [r, in], B [out, r])`` of ``expert`` (a global index)."""
        a, b = getattr(self, _name(projection, "A")), getattr(self, _name(projection, "B"))
        slot = self._slot[expert]
        return (a if a.dim() == 2 else a[slot]), (b if b.dim() == 2 else b[slot])

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_A.dtype

    def bound(self) -> "BoundExpertLoRA | None":
        """The factors for one forward of the layer (None when switched off)."""
        return BoundExpertLoRA(self) if self.enabled else None


    def extra_repr(self) -> str:
        return (f"layout={self.layout}, experts={self.experts[0]}..{self.experts[-1]}, hidden={self.hidden}, "
                f"width={self.width}, rank={self.rank}, scale={self.scale:g}")

    # -- the PEFT layout, per expert ------------------------------------------------------
    def peft_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The factors under vLLM's MoE LoRA names below ``prefix`` (``...mlp.experts``), one pair per expert
        and projection; a factor the layer's experts share is written for each of them."""
        out = {}
        for projection in PROJECTIONS:
            for part, shared in zip(("A", "B"), shares(self.layout, projection)):
                param = getattr(self, _name(projection, part)).detach().cpu()
                for expert in self.experts:
                    value = param if shared else param[self._slot[expert]]
                    out[f"{prefix}.{expert}.{projection}.lora_{part}.weight"] = value.clone()  # safetensors: no shared storage
        return out

    def load_peft_tensors(self, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> None:
        """The inverse of :meth:`peft_tensors`: copies bit-exactly; a shared factor must be the same for every expert."""
        from orbitctl.errors import InputFileError

        with torch.no_grad():
            for projection in PROJECTIONS:
                for part in ("A", "B"):
                    param = getattr(self, _name(projection, part))
                    for expert in self.experts:
                        key = f"{prefix}.{expert}.{projection}.lora_{part}.weight"
                        if key not in tensors:
                            raise InputFileError(f"{where}: no tensor {key}",
                                                 fix=f"the adapter was not trained with adapter.experts: {self.layout}")
                        value = tensors[key]
                        target = param if param.dim() == 2 else param[self._slot[expert]]
                        if tuple(value.shape) != tuple(target.shape):
                            raise InputFileError(f"{where}: {key} has shape {list(value.shape)}, the model "
                                                 f"expects {list(target.shape)}", fix="check adapter.experts_rank")
                        if param.dim() == 2 and expert != self.experts[0] and not torch.equal(value.to(param.dtype), param):
                            raise InputFileError(f"{where}: {key} differs from expert {self.experts[0]}'s, but "
                                                 f"adapter.experts: {self.layout} shares it",
                                                 fix="load it with adapter.experts: per-expert")
                        target.copy_(value)


class BoundExpertLoRA:
    """One forward's view of an :class:`ExpertLoRA`: each per-expert factor split once into its experts'
    matrices (``unbind``). Indexing the stacked factor per expert instead would make autograd build a
    zero-filled gradient of the whole stack for every expert; ``unbind``'s backward stacks the
    experts' gradients once."""

    def __init__(self, lora: ExpertLoRA) -> None:
        self.scale, self.dtype, self._slot, self.layout = lora.scale, lora.dtype, lora._slot, lora.layout
        self._factors = {}
        for projection in PROJECTIONS:
            for part in ("A", "B"):
                param = getattr(lora, _name(projection, part))
                self._factors[projection, part] = param if param.dim() == 2 else param.unbind(0)

    def _get(self, projection: str, part: str, expert: int) -> torch.Tensor:
        value = self._factors[projection, part]
        return value if isinstance(value, torch.Tensor) else value[self._slot[expert]]

    def delta(self, projection: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``s * (x A^T) B^T`` for the rows ``x`` (in the adapters' dtype) routed to ``expert``: two matmuls
        through the rank. Autograd keeps ``x`` and the ``[rows, r]`` product for the factors' gradients."""
        a, b = self._get(projection, "A", expert), self._get(projection, "B", expert)
        return (x @ a.t()) @ b.t() * self.scale


def _name(projection: str, part: str) -> str:
    return f"{projection.split('_')[0]}_{part}"


CPU_ROW_BITS = 3
"""The CPU expert matmuls' row counts keep their top 3 + 1 bits: 8 steps per octave (see :func:`cpu_rows`)."""


def cpu_rows(rows: int) -> int:
    """The row count a CPU expert matmul runs at: ``rows`` up to 16, else rounded up to the next of 8 steps
    per octave (at most 1/8 more rows, 1/16 on average).

    oneDNN builds a kernel for each new bf16 matmul shape (0.6-0.7 ms on a 2-core EPYC against 20-80 µs
    for a cached one), and the routed experts meet a new row count at nearly every forward: a tiny MoE
    step met 55-86 new shapes, a sixth of its time. With the rows on this grid the shapes repeat after
    the first steps. Padded rows are zeros: they add nothing to the real rows, nor to any gradient.
    """
    step = 1 << max(rows.bit_length() - 1 - CPU_ROW_BITS, 0)
    return -(-rows // step) * step


def expert_forward(expert, act_fn, x: torch.Tensor, lora: BoundExpertLoRA | None, index: int) -> torch.Tensor:
    """One routed expert on its rows: ``down(act(gate(x)) * up(x))``, each projection with its adapter term
    (``lora``: the layer's :meth:`ExpertLoRA.bound`, taken once per forward of the layer).

    The one place the MoE layers (:class:`~orbitctl.model.quant_linear.QuantExperts`, the
    expert-parallel layer) compute an expert, so the adapters act alike on every path. On the CPU
    the rows are padded to :func:`cpu_rows`.
    """
    rows = x.shape[0]
    grid = cpu_rows(rows) if x.device.type == "cpu" else rows
    if grid != rows:
        padded = torch.nn.functional.pad(x, (0, 0, 0, grid - rows))
        return _expert_rows(expert, act_fn, padded, lora, index)[:rows]
    return _expert_rows(expert, act_fn, x, lora, index)


def experts_by_row(module, experts: torch.Tensor, rows_of, lora: BoundExpertLoRA | None,
                   *, restore_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``module``'s experts (``module.expert(e)``, ``module.act_fn``) on the rows of ``experts``, row ``i`` by
    expert ``experts[i]``: the rows sorted by expert once (a stable argsort) and cut into one contiguous run
    per expert hit, so a layer issues one gather, one sort and one pass over the experts hit, whatever the
    routing. ``rows_of(order)`` gives the input rows in that order (``x[order]``, or a gather of the tokens).
    Returns ``(out, order)``: with ``restore_order`` ``out[i]`` is row ``i``'s result, else ``out[j]`` is the
    result of row ``order[j]``."""
    order = torch.argsort(experts, stable=True)
    rows = rows_of(order)
    if rows.shape[0] == 0:  # nothing routed here: no expert runs, the result is as empty as the input
        return rows, order
    ids, counts = _runs(experts[order], module.held)
    runs = torch.split(rows, counts)
    out = torch.cat([expert_forward(module.expert(e), module.act_fn, run, lora, e) for e, run in zip(ids, runs)])
    if not restore_order:
        return out, order
    return out[torch.argsort(order)], order


def _runs(sorted_experts: torch.Tensor, held: range) -> tuple[list[int], list[int]]:
    """(the experts hit, in order; the rows of each) of a routing sorted by expert: read by the host (the loop runs
    eagerly). Under fake tensors (the CUDA rehearsal, :mod:`orbitctl.dist.rehearsal`), which hold no routing, every
    held expert takes an even share of the rows, so each one's forward runs."""
    from torch._subclasses.fake_tensor import is_fake

    from orbitctl.dist.collectives import even_split

    if is_fake(sorted_experts):
        return list(held), even_split(sorted_experts.shape[0], len(held))
    ids, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
    return ids.tolist(), counts.tolist()


def _expert_rows(expert, act_fn, x: torch.Tensor, lora: BoundExpertLoRA | None, index: int) -> torch.Tensor:
    gate, up = expert.gate_up(x) if hasattr(expert, "gate_up") else (expert.gate_proj(x), expert.up_proj(x))
    if lora is None:
        return expert.down_proj(act_fn(gate) * up)
    xa = x.to(lora.dtype)  # one copy for gate and up (none when the dtypes agree)
    gate = gate + lora.delta("gate_proj", index, xa).to(x.dtype)
    up = up + lora.delta("up_proj", index, xa).to(x.dtype)
    h = act_fn(gate) * up
    return expert.down_proj(h) + lora.delta("down_proj", index, h.to(lora.dtype)).to(h.dtype)


def expert_layers(model) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every routed-expert module that can carry an :class:`ExpertLoRA`."""
    return [(name, module) for name, module in model.named_modules() if hasattr(module, "expert_lora")]


def attach_expert_lora(model, layout: str, rank: int, alpha: float, dtype: torch.dtype, *, seed: int,
                       first_layer: int = 0) -> int:
    """Give every routed-expert module of ``model`` from decoder layer ``first_layer`` on its adapters; returns the
    trainable parameters added."""
    layers = [(name, m) for name, m in expert_layers(model) if (layer_index(name) or 0) >= first_layer]
    if not layers:
        from orbitctl.errors import UserError

        raise UserError("adapter.experts: this model has no routed experts orbitctl loads (quant.format int4 or "
                        "fp8 with quant.modules covering the experts)",
                        fix="set adapter.experts: none, or quantize the routed experts to int4/fp8")
    torch.manual_seed(seed)
    added = 0
    for _, module in layers:
        first = module.expert(module.held[0])  # the first expert this rank holds
        hidden, width = first.gate_proj.in_features, first.gate_proj.out_features
        device = next(first.buffers(), None)
        device = device.device if device is not None else None
        # every expert's factors, also under expert parallelism: a rank computes with its own experts'
        # only, so the others get zero gradients there and the data-parallel average over the ranks is
        # each owner's gradient; the same draws as one process holding every expert
        module.expert_lora = ExpertLoRA(layout, range(module.num_experts), hidden, width, rank, alpha, dtype, device)
        added += sum(p.numel() for p in module.expert_lora.parameters())
    return added


def expert_lora_tensors(model) -> dict[str, torch.Tensor]:
    """Every expert adapter of ``model`` in the PEFT layout (names as PEFT saves its own LoRA)."""
    out = {}
    for name, module in expert_layers(model):
        if module.expert_lora is not None:
            out.update(module.expert_lora.peft_tensors(_peft_prefix(name)))
    return out


def load_expert_lora_tensors(model, tensors: dict[str, torch.Tensor], where: str) -> None:
    for name, module in expert_layers(model):
        if module.expert_lora is not None:
            module.expert_lora.load_peft_tensors(_peft_prefix(name), tensors, where)


def set_expert_lora_enabled(model, enabled: bool) -> list[ExpertLoRA]:
    """Switch every expert adapter on or off; returns those that were on (to switch back)."""
    switched = []
    for _, module in expert_layers(model):
        lora = module.expert_lora
        if lora is not None and lora.enabled != enabled:
            lora.enabled = enabled
            switched.append(lora)
    return switched


def _peft_prefix(module_name: str) -> str:
    """PEFT's saved names drop the adapter name and start at ``base_model.model``."""
    if module_name.startswith("base_model.model."):
        return module_name
    return "base_model.model." + module_name
