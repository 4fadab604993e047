"""Training on a tied-embedding base: a tiny llama with ``tie_word_embeddings`` named by ``model.path`` alone.

Its NF4 base keeps one bf16 embedding that the output layer uses; the adapters never touch it, the chunked loss
applies the same tied output layer chunk by chunk, and a short GRPO run moves the adapters.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

# a reward half of any model's first characters earn, so a random-init model's groups have a spread
PARITY_REWARD = "def score(completion, answer):\n    return float(completion[:1] != '' and ord(completion[0]) % 2 == 0)\n"


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    from orbitctl.model.tiny import build_tiny_char_model

    return build_tiny_char_model(tmp_path_factory.mktemp("tied-source") / "hf", tie_word_embeddings=True)


def _tied(checkpoint: Path) -> dict:
    """Overrides that make the small demo profile train the tied checkpoint instead of the demo model."""
    return {"model": {"path": str(checkpoint)}}


def _neighbour(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tied(tmp_path_factory, tied_checkpoint):
    """(profile, policy, prompts) of the tied demo model with random adapters, every loss term switched on."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.model.adapters import randomize_adapters
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(_neighbour("conftest").small_profile_yaml(tmp_path_factory.mktemp("tied"), "tied", **{
        **_tied(tied_checkpoint), "rl.algorithm": "ppo", "rl.kl_ref_coef": 0.05, "rollout.temperature": 0.7}))
    split = load_prompts(profile.data, profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    randomize_adapters(policy.model, seed=0, std=0.05)
    return profile, policy, split


def test_the_output_layer_is_the_embedding_and_no_adapter_wraps_it(tied):
    profile, policy, _ = tied
    assert profile.quant.format == "nf4"
    embedding = policy.model.get_input_embeddings()
    assert type(policy.output_layer) is torch.nn.Linear and policy.output_layer.weight is embedding.weight
    assert not embedding.weight.requires_grad
    trainable = [n for n, _ in policy.named_trainable()]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed_tokens" in n for n in trainable)
    adapted = {n.rsplit(".", 1)[0] for n, m in policy.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted and not any(n.endswith("lm_head") for n in adapted)


def test_chunked_step_equals_the_unchunked_step_with_a_tied_output_layer(tied):
    """The neighbour's check (tests/train/test_chunked_loss.py), run on the tied model: chunks of 4 positions
    through ``Policy.output_layer`` give the unchunked loss, metrics and gradients within its floor."""
    _neighbour("test_chunked_loss").test_chunked_step_equals_the_unchunked_step(tied)


def test_tied_model_trains_with_the_chunked_loss(small_profile, tied_checkpoint, tmp_path, monkeypatch):
    """Two GRPO steps with the chunked loss: every LoRA B factor moves off zero; the adapter holds nothing of the
    tied output layer."""
    from safetensors.torch import load_file

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.rl.api import train

    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    profile = small_profile("tied-run", **_tied(tied_checkpoint), **{
        "rl.steps": 2, "memory.loss_chunk_size": 4, "data.reward": "python:parity_reward:score"})
    result = train(profile)
    records = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["update_applied"] for r in records)
    assert all(r["grad_norm"] > 0 for r in records)
    saved = load_file(str(next((Path(result.run_dir) / "adapter").glob("*.safetensors"))))
    assert saved and not any("lm_head" in n or "embed_tokens" in n for n in saved)
    # the same profile's fresh policy: its LoRA B factors start at zero, the trained ones do not
    fresh = load_policy(profile, prepare_frozen_base(profile, load_prompts(profile.data, profile.run.seed).warm_task))
    fresh_b = {n: p for n, p in fresh.named_trainable() if "lora_B" in n}
    assert fresh_b and all(float(p.detach().abs().max()) == 0 for p in fresh_b.values())
    trained_b = [t for n, t in saved.items() if "lora_B" in n]
    assert len(trained_b) == len(fresh_b) and all(float(t.abs().max()) > 0 for t in trained_b)
