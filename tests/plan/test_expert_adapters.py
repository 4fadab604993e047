"""The planner's routed-expert adapters (adapter.experts): counts, states under EP, activations, shipped profiles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from orbitctl.plan import plan_profile
from orbitctl.plan.activations import ActivationSettings, expert_adapter_saved, layer_activations
from orbitctl.plan.adapters import plan_adapters

REPO = Path(__file__).resolve().parents[2]
KIMI = dict(hidden=7168, width=2048, experts=384, layers=60)


def _kimi(make_profile, **adapter):
    return make_profile(model={"arch": "kimi-k2"}, adapter={"rank": 64, "targets": "attention+shared", **adapter})


@pytest.mark.parametrize("layout,formula", [
    ("per-expert", lambda d, f, e, r: 3 * e * r * (d + f)),
    ("shared-outer", lambda d, f, e, r: 3 * r * (d + e * f)),
    ("shared", lambda d, f, e, r: 3 * r * (d + f)),
])
def test_trainable_parameters_follow_the_layout_formula(make_profile, layout, formula):
    from orbitctl.plan import _arch

    none = _kimi(make_profile)
    profile = _kimi(make_profile, experts=layout, experts_rank=32)
    arch = _arch(profile)
    ad = plan_adapters(arch, profile.adapter)
    expected = KIMI["layers"] * formula(KIMI["hidden"], KIMI["width"], KIMI["experts"], 32)
    assert arch.moe_layers == KIMI["layers"] and ad.expert_params == expected
    assert ad.trainable_params == plan_adapters(arch, none.adapter).trainable_params + expected


def test_expert_adapter_states_are_counted_like_every_adapter(make_profile):
    """Under EP 8 with ZeRO-2 every GPU keeps all experts' factors (replicated); ZeRO shards their optimizer state."""
    def states(layout):
        p = make_profile(model={"arch": "kimi-k2"}, hardware={"gpu": "b200", "gpus_per_node": 8},
                         memory={"zero_stage": 2, "expert_parallel": 8, "dense_layout": "replicated"},
                         adapter={"rank": 64, "targets": "attention+shared", "experts": layout,
                                  **({"experts_rank": 8} if layout != "none" else {})})
        b = plan_profile(p, with_advice=False).per_gpu_bytes
        return b["adapter_weights"], b["optimizer_adam"]

    from orbitctl.plan import _arch

    arch = _arch(_kimi(make_profile))
    extra = plan_adapters(arch, _kimi(make_profile, experts="per-expert", experts_rank=8).adapter).expert_params
    (w0, adam0), (w1, adam1) = states("none"), states("per-expert")
    assert w1 - w0 == pytest.approx(2 * extra, rel=1e-9)  # bf16 weights, whole on each GPU
    assert adam1 - adam0 == pytest.approx(8 * extra / 8, rel=1e-9)  # fp32 m and v, sharded over 8 GPUs


def test_activations_add_the_expert_adapters_saved_tensors(make_profile):
    from orbitctl.plan import _arch

    base, adapted = _kimi(make_profile), _kimi(make_profile, experts="shared-outer", experts_rank=32)
    arch = _arch(base)
    layer = next(l for l in arch.layers if l.moe)
    st = ActivationSettings(tokens=4096, seq_len=4096, checkpointing=True, offload=False, flash=True, dropout=False,
                            adapter_bytes=2, loss_chunk=0)
    extra = layer_activations(arch, layer, plan_adapters(arch, adapted.adapter), st).saved - \
        layer_activations(arch, layer, plan_adapters(arch, base.adapter), st).saved
    assert extra == 8 * expert_adapter_saved(7168, 2048, 32, 2) == 8 * 2 * (7168 + 2048 + 96)


def test_measured_expert_lora_transient_is_the_planned_term():
    """MemTracker under FakeTensorMode, one MoE layer (benchmarks/expert_lora_memory.py at a small width):
    the adapters' extra activations and temporaries are within 10% of the planner's term, each layout."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("expert_lora_memory", REPO / "benchmarks" / "expert_lora_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.run(hidden=512, width=256, experts=16, top_k=4, tokens=512, rank=8, peft=False)
    assert out["predicted_expert_lora_bytes"] == 4 * 512 * 2 * (512 + 256 + 24)
    for layout, row in out["adapters"].items():
        assert 0.9 <= row["ratio"] <= 1.1, (layout, row)


def test_shipped_moe_profiles_adapt_the_experts_and_fit(make_profile):
    from orbitctl.profile import load_profile

    for name, layout in [("kimi-k2_grpo_int4_8xb200", "shared-outer"), ("kimi-k2_grpo_int4_8xh200", "shared"),
                         ("deepseek-v3_grpo_int4_8xh200", "shared-outer")]:
        profile = load_profile(REPO / "profiles" / f"{name}.yaml")
        assert profile.adapter.experts == layout
        assert plan_profile(profile, with_advice=False).fits, name
    # shared-outer does not fit Kimi-K2 on H200s: the plan says by how much
    h200 = load_profile(REPO / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml", ["adapter.experts=shared-outer"])
    plan = plan_profile(h200, with_advice=False)
    assert not plan.fits and plan.peak_bytes > plan.usable_bytes


def test_expert_adapter_keys_that_would_do_nothing_are_refused():
    from orbitctl.errors import ProfileError
    from orbitctl.profile import load_profile

    tiny = REPO / "profiles" / "tiny-moe-cpu.yaml"
    for sets, words in [(["adapter.experts_rank=4"], "experts is none"),
                        (["adapter.experts=shared", "adapter.kind=bottleneck"], "kind is bottleneck"),
                        (["adapter.experts=shared", "adapter.targets=attention+mlp"], "adapts them too"),
                        (["adapter.experts=shared", "adapter.experts_rank=0"], "must be >= 1")]:
        with pytest.raises(ProfileError, match=words):
            load_profile(tiny, sets)


@pytest.mark.parametrize("name", ["kimi-k2_grpo_int4_8xh200.yaml", "kimi-k2_grpo_int4_8xb200.yaml"])
def test_plan_json_reports_the_routed_expert_adapters_the_text_prints(name):
    """--json says what the plan computed about the routed experts (layout, rank, parameters, bytes), the same
    layout and count the text output's note prints; the old boolean that said the opposite is gone."""
    import json
    import re

    from typer.testing import CliRunner

    from orbitctl.cli.app import app
    from orbitctl.plan.adapters import expert_adapter_params

    path = str(REPO / "profiles" / name)
    runner = CliRunner()
    document = json.loads(runner.invoke(app, ["plan", path, "--json"]).stdout)
    text = runner.invoke(app, ["plan", path]).stdout
    experts = document["details"]["routed_expert_adapters"]
    assert "adapts_routed_experts" not in document["details"]
    note = re.search(r"routed-expert adapters: (\S+) rank (\d+), ([\d.]+) B parameters", text)
    assert note is not None, text
    assert (experts["layout"], experts["rank"]) == (note[1], int(note[2])) and experts["layout"] != "none"
    assert f"{experts['params'] / 1e9:.3g}" == note[3]
    # the count is the layout's formula over every MoE layer, and part of params_trainable
    expected = KIMI["layers"] * expert_adapter_params(experts["layout"], KIMI["experts"], KIMI["hidden"],
                                                      KIMI["width"], experts["rank"])
    assert experts["params"] == expected and experts["params"] < document["params_trainable"]
    import yaml

    dtype = yaml.safe_load((REPO / "profiles" / name).read_text())["adapter"].get("dtype", "auto")
    assert experts["bytes"] == experts["params"] * (2 if dtype == "bf16" else 4)
    assert experts["via_targets"] is False


def test_plan_json_names_experts_adapted_through_the_targets(make_profile):
    """adapter.targets reaching the routed experts (PEFT over the stacked experts) is reported apart from
    adapter.experts, and its advice still fires."""
    plan = plan_profile(_kimi(make_profile, targets="attention+mlp"))
    experts = plan.details["routed_expert_adapters"]
    assert experts == {"layout": "none", "rank": 0, "params": 0, "bytes": 0, "via_targets": True}
    assert any("PEFT builds every expert's bf16 weight" in n for n in plan.notes)
