"""LoRA on the routed INT4 experts: each layout computes what materialising W_deq + s B_e A_e per expert computes.

The reference dequantizes every expert to fp32, adds the scaled product of its factors, and runs
the layer with those dense weights; the adapted layer never forms either. Both run on the same
factor tensors, so their gradients are compared too. Relative errors are bounded by 1e-5 (the
issue's bound; the two differ by fp32 summation order only).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from orbitctl.model.expert_lora import ExpertLoRA, attach_expert_lora, cpu_rows, expert_layers  # noqa: E402
from orbitctl.plan.adapters import expert_adapter_params  # noqa: E402

LAYOUTS = ("shared", "shared-outer", "per-expert")


def _experts_module(path):
    from orbitctl.model.frozen_base import load_frozen_base

    model = load_frozen_base(path, compute_dtype=torch.float32)
    layers = expert_layers(model)
    assert len(layers) == 2  # the two MoE layers of the tiny model
    return model, layers[0][1]


def _randomise(lora: ExpertLoRA, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():  # B starts at zero; give it values so every gradient is non-trivial
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _reference(module, lora: ExpertLoRA, x, index, weights):
    """The layer with every expert's weight materialised as W_deq + s B_e A_e (fp32)."""
    out = torch.zeros_like(x)
    for e in module.held:
        expert = module.expert(e)
        dense = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            a, b = lora.factors(proj, e)
            dense[proj] = getattr(expert, proj).dequantized_weight(torch.float32) + lora.scale * (b @ a)
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        h = x[token]
        y = (module.act_fn(h @ dense["gate_proj"].t()) * (h @ dense["up_proj"].t())) @ dense["down_proj"].t()
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out


def _inputs(hidden: int, experts: int, k: int = 2, tokens: int = 40):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    return x, index, weights


@pytest.mark.parametrize("tokens", [40, 200])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_equals_the_materialised_reference(int4_moe, layout, tokens):
    model, module = _experts_module(int4_moe)
    attach_expert_lora(model, layout, rank=4, alpha=8.0, dtype=torch.float32, seed=0)
    lora = module.expert_lora
    first = module.expert(0).gate_proj
    hidden, width = first.in_features, first.out_features
    assert sum(p.numel() for p in lora.parameters()) == expert_adapter_params(layout, 8, hidden, width, 4)
    _randomise(lora, 1)
    x, index, weights = _inputs(hidden, 8, tokens=tokens)
    if tokens > 40:  # rows off the CPU matmul grid: padded with zeros, and the padding never reaches a gradient
        assert any(cpu_rows(int((index == e).sum())) > int((index == e).sum()) for e in range(8))

    def run(fn):
        for p in lora.parameters():
            p.grad = None
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return y.detach(), xi.grad, {n: p.grad.clone() for n, p in lora.named_parameters()}

    got, got_dx, got_grads = run(lambda xi: module(xi, index, weights))
    ref, ref_dx, ref_grads = run(lambda xi: _reference(module, lora, xi, index, weights))

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(got, ref) <= 1e-5 and rel(got_dx, ref_dx) <= 1e-5
    assert got_grads.keys() == ref_grads.keys() and len(got_grads) == 6
    for name in ref_grads:
        assert ref_grads[name].abs().max() > 0, name
        assert rel(got_grads[name], ref_grads[name]) <= 1e-5, name
    # switched off (the reference policy), the layer is the base layer again
    lora.enabled = False
    off = module(x, index, weights)
    module.expert_lora = None
    base = module(x, index, weights)
    assert torch.equal(off, base) and not torch.allclose(base, got)


def test_cpu_row_grid_bounds_the_padding_and_the_shapes():
    grid = [cpu_rows(m) for m in range(1, 4097)]
    assert grid[:16] == list(range(1, 17))  # small counts run as they are
    assert all(m <= g <= m * 9 / 8 for m, g in zip(range(1, 4097), grid))  # at most 1/8 more rows
    assert all(cpu_rows(g) == g for g in grid)  # a padded count is on the grid
    assert len(set(grid)) == 16 + 8 * 8  # 8 row counts per octave from 16 to 4096: kernels repeat


def test_b_at_zero_starts_at_the_base(int4_moe):
    model, module = _experts_module(int4_moe)
    x, index, weights = _inputs(module.expert(0).gate_proj.in_features, 8)
    before = module(x, index, weights)
    attach_expert_lora(model, "per-expert", rank=4, alpha=8.0, dtype=torch.float32, seed=0)
    assert torch.equal(module(x, index, weights), before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saved_in_peft_names_and_reloaded_bit_exactly(int4_moe, tmp_path, layout):
    from peft import LoraConfig, get_peft_model

    from orbitctl.model.adapters import load_lora, save_adapter
    from orbitctl.model.frozen_base import load_frozen_base

    model = load_frozen_base(int4_moe, compute_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj"]))
    attach_expert_lora(peft_model, layout, rank=2, alpha=4.0, dtype=torch.float32, seed=0)
    for i, (_, module) in enumerate(expert_layers(peft_model)):
        _randomise(module.expert_lora, 10 + i)
    save_adapter(peft_model, tmp_path, "lora", 0)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    names = [k for k in saved if ".experts." in k]
    # 2 MoE layers x 8 experts x 3 projections x (A, B), every layout written per expert
    assert len(names) == 2 * 8 * 3 * 2
    assert "base_model.model.model.layers.1.mlp.experts.5.down_proj.lora_B.weight" in saved
    assert saved["base_model.model.model.layers.1.mlp.experts.5.gate_proj.lora_A.weight"].shape[0] == 2
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert "model.layers.2.mlp.experts.7.up_proj" in config["target_modules"]
    assert set(config["rank_pattern"].values()) == {2}

    reloaded = load_lora(load_frozen_base(int4_moe, compute_dtype=torch.float32), tmp_path, dtype="fp32")
    for (_, a), (_, b) in zip(expert_layers(peft_model), expert_layers(reloaded)):
        assert b.expert_lora.layout == layout
        for (na, pa), (nb, pb) in zip(a.expert_lora.named_parameters(), b.expert_lora.named_parameters()):
            assert na == nb and torch.equal(pa, pb), na
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_a_shared_factor_that_differs_per_expert_is_refused(int4_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    from orbitctl.errors import InputFileError
    from orbitctl.model.expert_lora import load_expert_lora_tensors

    model, module = _experts_module(int4_moe)
    attach_expert_lora(model, "shared", rank=2, alpha=4.0, dtype=torch.float32, seed=0)
    tensors = module.expert_lora.peft_tensors("p")
    tensors["p.3.gate_proj.lora_A.weight"] = tensors["p.3.gate_proj.lora_A.weight"] + 1
    file = tmp_path / "a.safetensors"
    save_file(tensors, str(file))
    with pytest.raises(InputFileError, match="differs from expert 0"):
        module.expert_lora.load_peft_tensors("p", load_file(str(file)), str(file))
    with pytest.raises(InputFileError, match="no tensor"):
        load_expert_lora_tensors(model, {}, str(file))


def test_counts_match_the_issue_for_kimi_k2():
    # Kimi-K2: 60 MoE layers, hidden 7168, expert width 2048, 384 experts, r = 32
    counts = {layout: 60 * expert_adapter_params(layout, 384, 7168, 2048, 32) for layout in LAYOUTS}
    assert round(counts["per-expert"] / 1e9, 1) == 20.4
    assert round(counts["shared-outer"] / 1e9, 1) == 4.6
    assert round(counts["shared"] / 1e6) == 53


def test_attention_plus_shared_adapts_the_dense_and_shared_mlps(int4_moe):
    """PEFT would rewrite gate/up/down_proj targets of DeepSeek-type models into fused-expert parameters and
    leave the dense layer's MLP and the shared expert unadapted; orbitctl's resolved targets all get LoRA."""
    from orbitctl.model.adapters import attach_lora, resolve_targets
    from orbitctl.model.frozen_base import load_frozen_base
    from orbitctl.profile.schema import AdapterSection

    model = load_frozen_base(int4_moe, compute_dtype=torch.float32)
    wanted = resolve_targets(model, "attention+shared")
    assert any(".mlp.shared_experts." in n for n in wanted) and any(n.endswith("layers.0.mlp.down_proj") for n in wanted)
    peft_model, report = attach_lora(model, AdapterSection(rank=4, targets="attention+shared", dtype="fp32"), 64, seed=0)
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert set(wanted) <= adapted
    assert report.trainable_params == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
