"""`orbitctl serve` on a tied-embedding base (a tiny llama with ``tie_word_embeddings``, named by ``model.path``):
one completion over HTTP is the infer path's own, computed through the output layer that is the embedding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

DEMO = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tied_engine(tmp_path_factory, model_cache):
    from orbitctl.model.tiny import build_tiny_char_model
    from orbitctl.profile import load_profile
    from orbitctl.serve.api import build_engine

    root = tmp_path_factory.mktemp("tied-serve")
    source = build_tiny_char_model(root / "hf", tie_word_embeddings=True)
    data = yaml.safe_load(DEMO.read_text())
    data["name"], data["model"] = "tied", {"path": str(source)}
    (root / "tied.yaml").write_text(yaml.safe_dump(data))
    return build_engine(load_profile(root / "tied.yaml"))


def test_one_completion_over_http_uses_the_tied_output_layer(tied_engine):
    import httpx

    from orbitctl.model.adapters import adapters_disabled
    from orbitctl.serve.api import start_background

    policy = tied_engine.policy
    head, embedding = policy.output_layer, policy.model.get_input_embeddings()
    assert type(head) is torch.nn.Linear and head.weight is embedding.weight
    server = start_background(tied_engine)
    try:
        reply = httpx.post(f"{server.url}/completions", timeout=60, json={
            "model": "tied", "prompt": "7+5:", "max_tokens": 4, "temperature": 0, "logprobs": 1})
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    prompt_ids = policy.tokenizer("7+5:")["input_ids"]
    ids = torch.tensor([prompt_ids])
    with adapters_disabled(policy.model):  # a fresh LoRA's B is zero: the same numbers as the base
        out = policy.sample(ids, torch.ones_like(ids), max_new_tokens=4, temperature=0.0, top_p=1.0, generator=None)
    kept = int(out.completion_mask[0].sum())
    assert kept > 0 and choice["token_ids"] == out.completion_ids[0, :kept].tolist()
    assert choice["logprobs"]["token_logprobs"] == out.logprobs[0, :kept].tolist()
    # greedy through the embedding: each served token is the argmax of the output layer's input times embed_tokens^T
    seq = torch.tensor([prompt_ids + choice["token_ids"]])
    seen = {}
    hook = head.register_forward_hook(lambda module, args, output: seen.update(hidden=args[0]))
    with torch.no_grad(), adapters_disabled(policy.model):
        policy.model(seq)
    hook.remove()
    logits = torch.nn.functional.linear(seen["hidden"], embedding.weight)
    start = len(prompt_ids) - 1
    assert logits[0, start:start + kept].argmax(-1).tolist() == choice["token_ids"]
