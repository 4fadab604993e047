"""Expert LoRA's memory on one MoE layer at real width, measured without allocating it.

    python benchmarks/expert_lora_memory.py                 # Kimi-K2: hidden 7168, expert width 2048, 384 experts, top-8
    python benchmarks/expert_lora_memory.py --tokens 1024 --rank 16

One MoE layer's routed experts, one micro-batch of tokens, forward + backward, under
``FakeTensorMode`` with ``MemTracker`` counting every tensor by category:

- ``int4``: orbitctl's frozen INT4 experts (QuantLinear, dequantized per expert), no adapters;
- ``int4 + <layout>``: the same with orbitctl's expert LoRA (``adapter.experts``), each layout;
- ``bf16 fused``: transformers' stacked bf16 experts ([E, 2f, d] and [E, d, f], grouped_mm);
- ``bf16 fused + PEFT``: PEFT's LoRA on those stacked parameters (``target_parameters``), which
  adds ``B A`` to every expert's weight on each forward.

The adapters' transient is a row's activations and temporaries minus those of the same layer
without adapters; for expert LoRA it is printed beside what the planner predicts for that term
(``orbitctl.plan.activations.expert_adapter_saved``, per routed token). Tokens are spread over the
experts evenly (the layer's worst case is the same total; fake tensors have no values to route by).
"""

from __future__ import annotations

import argparse
import json

KIMI = {"hidden": 7168, "width": 2048, "experts": 384, "top_k": 8}


def _materialise(model, device: str = "cpu") -> None:
    """Fake tensors for every parameter and buffer of a model built on the meta device; frozen
    parameters become buffers (MemTracker hooks the gradients of parameters only)."""
    import torch

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if p.requires_grad:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))
            else:
                del module._parameters[name]
                module._buffers[name] = torch.empty(p.shape, dtype=p.dtype, device=device)
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _slots(tokens: int, top_k: int, experts: int) -> list[int]:
    total = tokens * top_k
    per, extra = divmod(total, experts)
    return [per + (1 if e < extra else 0) for e in range(experts)]


def _int4_experts(hidden: int, width: int, experts: int, group: int = 32):
    import torch
    import torch.nn.functional as F

    from orbitctl.model.quant_linear import ExpertMLP, QuantExperts, QuantLinear

    def q(i, o):
        return QuantLinear(i, o, "int4", group_size=group, as_buffers=True)

    with torch.device("meta"):
        module = QuantExperts([ExpertMLP(q(hidden, width), q(hidden, width), q(width, hidden))
                               for _ in range(experts)], F.silu)
    return module


def _unhooked(expert):
    """An expert whose projections run their own ``forward`` (the same code) without ``Module.__call__``:
    MemTracker re-reads every module it has seen run on every op, which is quadratic in 1,152 projections."""
    from types import SimpleNamespace

    return SimpleNamespace(**{name: getattr(expert, name).forward for name in ("gate_proj", "up_proj", "down_proj")})


def _static_int4_forward(module, x, top_k: int):
    """QuantExperts.forward with the routing fixed in advance: expert e gets the next slots[e] (token, k) slots."""
    import torch

    from orbitctl.model.expert_lora import expert_forward

    tokens = x.shape[0]
    counts = _slots(tokens, top_k, module.num_experts)
    token_of = torch.randint(0, tokens, (sum(counts),))
    weights = torch.rand(sum(counts), 1, dtype=x.dtype)
    final = torch.zeros_like(x)
    lora = module.expert_lora.bound() if module.expert_lora is not None else None
    start = 0
    for e, n in enumerate(counts):
        rows = token_of[start:start + n]
        h = expert_forward(_unhooked(module.expert(e)), module.act_fn, x[rows], lora, e) * weights[start:start + n]
        final.index_add_(0, rows, h.to(final.dtype))
        start += n
    return final


def _fused_experts(hidden: int, width: int, experts: int, top_k: int, rank: int | None):
    import torch
    from transformers import AutoConfig
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    config = AutoConfig.for_model("deepseek_v3", hidden_size=hidden, moe_intermediate_size=width,
                                  n_routed_experts=experts, num_experts_per_tok=top_k, n_group=1, topk_group=1,
                                  num_hidden_layers=1)
    config._experts_implementation = "grouped_mm"

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = modeling_deepseek_v3.DeepseekV3Experts(config)

        def forward(self, x, index, weights):
            return self.experts(x, index, weights)

    with torch.device("meta"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Layer()
            layer.requires_grad_(False)  # a frozen base, as under PEFT
            if rank is not None:
                from peft import LoraConfig, get_peft_model

                layer = get_peft_model(layer, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                         target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
        finally:
            torch.set_default_dtype(previous)
    return layer


def measure(case: str, *, hidden: int, width: int, experts: int, top_k: int, tokens: int, rank: int) -> dict:
    """Peak bytes by MemTracker category for one forward + backward of one MoE layer's experts."""
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    warnings.filterwarnings("ignore", module="torch.distributed._tools")
    if case.startswith("int4"):
        model = _int4_experts(hidden, width, experts)
    else:
        model = _fused_experts(hidden, width, experts, top_k, rank if case.endswith("PEFT") else None)
    with FakeTensorMode():
        _materialise(model)
        if case.startswith("int4 + "):
            from orbitctl.model.expert_lora import ExpertLoRA

            model.expert_lora = ExpertLoRA(case.split(" + ")[1], range(experts), hidden, width, rank, 2.0 * rank,
                                           torch.bfloat16, "cpu")
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            if case.startswith("int4"):
                y = _static_int4_forward(model, x, top_k)
            else:
                index = torch.randint(0, experts, (tokens, top_k))
                y = model(x, index, torch.rand(tokens, top_k, dtype=torch.bfloat16))
            y.float().sum().backward()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by = {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}
    return {"case": case, "transient": by.get("Activation", 0) + by.get("Temp", 0), **by}


def run(*, hidden: int, width: int, experts: int, top_k: int, tokens: int, rank: int,
        layouts=("shared", "shared-outer", "per-expert"), peft: bool = True) -> dict:
    from orbitctl.plan.activations import expert_adapter_saved

    size = {"hidden": hidden, "width": width, "experts": experts, "top_k": top_k, "tokens": tokens, "rank": rank}
    rows = {"int4": measure("int4", **size)}
    for layout in layouts:
        rows[layout] = measure(f"int4 + {layout}", **size)
    if peft:
        rows["bf16 fused"] = measure("bf16 fused", **size)
        rows["PEFT"] = measure("bf16 fused + PEFT", **size)
    predicted = expert_adapter_saved(hidden, width, rank, adapter_bytes=2) * top_k * tokens
    out = {"size": size, "rows": rows, "predicted_expert_lora_bytes": predicted, "adapters": {}}
    for layout in layouts:
        extra = rows[layout]["transient"] - rows["int4"]["transient"]
        out["adapters"][layout] = {"measured_bytes": extra, "ratio": extra / predicted}
    if peft:
        out["adapters"]["PEFT stacked"] = {"measured_bytes": rows["PEFT"]["transient"] - rows["bf16 fused"]["transient"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=KIMI["hidden"])
    parser.add_argument("--width", type=int, default=KIMI["width"])
    parser.add_argument("--experts", type=int, default=KIMI["experts"])
    parser.add_argument("--top-k", type=int, default=KIMI["top_k"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = run(hidden=args.hidden, width=args.width, experts=args.experts, top_k=args.top_k, tokens=args.tokens,
              rank=args.rank)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    gib = 2.0 ** 30
    s = out["size"]
    print(f"one MoE layer: hidden {s['hidden']}, expert width {s['width']}, {s['experts']} experts top-{s['top_k']}, "
          f"{s['tokens']} tokens, rank {s['rank']}; forward + backward under FakeTensorMode (MemTracker peak)")
    print(f"{'case':<22}{'activations+temps':>20}{'params':>12}{'buffers':>12}{'grads':>12}")
    for name, row in out["rows"].items():
        print(f"{name:<22}{row['transient'] / gib:>17.3f} GiB{row.get('Parameter', 0) / gib:>8.3f} GiB"
              f"{row.get('Buffer', 0) / gib:>8.2f} GiB{row.get('Gradient', 0) / gib:>8.3f} GiB")
    print(f"adapter transient (the layer with adapters minus without); planner predicts "
          f"{out['predicted_expert_lora_bytes'] / gib:.3f} GiB for expert LoRA")
    for name, row in out["adapters"].items():
        ratio = f"  measured/predicted {row['ratio']:.3f}" if "ratio" in row else ""
        print(f"  {name:<20}{row['measured_bytes'] / gib:>9.3f} GiB{ratio}")


if __name__ == "__main__":
    main()
