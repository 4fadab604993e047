"""adapter.last_layers on a real model: adapters in the last layers only, and the backward stops at the first."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def _policy(tmp_path, kind: str, last_layers: int):
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(ROOT / "profiles" / "tiny-cpu.yaml",
                           [f"run.dir={tmp_path / 'run'}", f"adapter.kind={kind}", f"adapter.last_layers={last_layers}"])
    split = load_prompts(profile.data, profile.run.seed)
    return load_policy(profile, prepare_frozen_base(profile, split.warm_task)), split


@pytest.mark.parametrize("kind", ["lora", "bottleneck"])
def test_only_the_last_layer_trains_and_the_backward_never_reaches_the_first(kind, tmp_path, model_cache):
    from orbitctl.model.adapters import decoder_layers, layer_index

    policy, split = _policy(tmp_path, kind, 1)  # the demo base has 2 decoder layers
    trainable = [name for name, _ in policy.named_trainable()]
    assert trainable and all(layer_index(name) == 1 for name in trainable), trainable
    assert all(layer_index(name) == 1 for name in policy.report.modules)
    layers = decoder_layers(policy.model.get_base_model() if kind == "lora" else policy.model)
    calls = {0: 0, 1: 0}

    def counted(i):
        forward = layers[i].mlp.forward

        def call(*args, **kwargs):
            calls[i] += 1
            return forward(*args, **kwargs)
        return call

    # each layer's MLP, counted at its forward (a checkpointed layer's recompute does not run module hooks)
    for i in (0, 1):
        layers[i].mlp.forward = counted(i)
    try:
        ids, mask = policy.encode_prompts([item.prompt for item in split.train[:4]])
        out = policy.sample(ids, mask, max_new_tokens=3, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(0))
        calls.update({0: 0, 1: 0})
        logits = policy.completion_logits(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
        logits.float().logsumexp(-1).mean().backward()
    finally:
        for i in (0, 1):
            del layers[i].mlp.forward
    # gradient checkpointing recomputes the adapted layer in backward; the frozen layer below runs once
    assert calls == {0: 1, 1: 2}, calls
    grads = [p.grad for _, p in policy.named_trainable()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("command", ["plan", "train"])
def test_more_layers_than_the_model_has_exits_2_naming_the_key(command, tmp_path, model_cache, one_error_line,
                                                               capsys):
    from orbitctl.cli.app import main

    assert main([command, str(ROOT / "profiles" / "tiny-cpu.yaml"), "--set", f"run.dir={tmp_path / 'run'}",
                 "--set", "adapter.last_layers=3"]) == 2
    # train has started its process group by then, and DeepSpeed announces its CPU communication op on the way
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if not line.startswith("DeepSpeed "))
    one_error_line(err, "adapter.last_layers: 3", "2 decoder layers")
