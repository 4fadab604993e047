"""The trainer's http engine client against `orbitctl serve` over real HTTP, in both wire protocols.

vLLM's (batched token-id prompts to /v1/completions, tokens named ``token_id:N``) and SGLang's
(/generate, ``meta_info.output_token_logprobs``) must give the same completions for the same seed,
equal to the infer path called directly; a hot-loaded adapter must change the engine's log-probs,
and each later load replaces what the engine samples with.
"""

import json

import pytest
import torch

from orbitctl.model.draws import KeyedDraws
from orbitctl.rl.engine_http import HttpEngine

PROMPTS = [[1, 43, 45, 77, 53, 26], [1, 43, 45, 26]]


def _client(server, api):
    return HttpEngine(server.url, api, vocab_size=100, timeout_s=60, retries=0)


def _sample(client, model, seed=11, temperature=1.5):
    out = client.sample(model, PROMPTS, n=3, max_tokens=3, temperature=temperature, top_p=1.0, seed=seed)
    return [(c.ids, c.logprobs) for c in out]


def test_vllm_and_sglang_protocols_sample_the_same_completions_as_the_infer_path(engine, server):
    vllm, sglang = _sample(_client(server, "vllm"), engine.base_name), _sample(_client(server, "sglang"), engine.base_name)
    assert len(vllm) == 6 and vllm == sglang
    rows = [p for p in PROMPTS for _ in range(3)]
    width = max(map(len, rows))
    ids = torch.tensor([[engine.policy.pad_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    from orbitctl.model.adapters import adapters_disabled

    with engine._lock, adapters_disabled(engine.policy.model):
        out = engine.policy.sample(ids, mask, max_new_tokens=3, temperature=1.5, top_p=1.0, generator=None,
                                   draws=KeyedDraws(11, tuple(range(6))))
    for r, (got_ids, got_logprobs) in enumerate(vllm):
        kept = int(out.completion_mask[r].sum())
        assert got_ids == out.completion_ids[r, :kept].tolist()
        assert got_logprobs == out.logprobs[r, :kept].tolist()


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_each_hot_load_changes_what_the_engine_samples_with(engine, server, tmp_path, perturbed_adapter, api):
    client = _client(server, api)
    base = _sample(client, engine.base_name, temperature=0.0)
    seen = [base]
    for step, scale in enumerate((0.5, 1.0)):
        name = f"{api}-step-{step}"
        client.load_adapter(name, perturbed_adapter(tmp_path / name, scale))
        now = _sample(client, name, temperature=0.0)
        assert all(now != before for before in seen), step  # greedy log-probs moved with every load
        seen.append(now)
        client.unload_adapter(name)
    assert _sample(client, engine.base_name, temperature=0.0) == base


def test_the_native_route_answers_as_sglang_does(server):
    import httpx

    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2}
    answer = httpx.post(server.url.removesuffix("/v1") + "/generate", json=body, timeout=60).json()
    meta = answer["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == answer["output_ids"]
    assert len(meta["output_top_logprobs"]) == len(answer["output_ids"])
    assert meta["output_top_logprobs"][0][0][1] == answer["output_ids"][0]  # greedy: the top token was drawn
    assert meta["finish_reason"]["type"] in ("stop", "length")
    refused = httpx.post(server.url.removesuffix("/v1") + "/generate", json={**body, "stream": True}, timeout=60)
    assert refused.status_code == 422 and "stream" in json.dumps(refused.json())
