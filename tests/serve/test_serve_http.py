"""`orbitctl serve` over real HTTP: the openai client gets the infer path's own tokens and log-probs.

The server runs on a loopback port on a thread (tests/serve/conftest.py); each test compares what
it answers with the policy called directly, so a wrong shape, a wrong adapter or a re-tokenized
prompt fails here.
"""

import httpx
import openai
import pytest
import torch

from orbitctl.data.tasks import ChatPrompt
from orbitctl.model.adapters import adapters_disabled
from orbitctl.model.draws import KeyedDraws

PROMPT = "+-M5:"
WILD = "q"
"""A prompt far from the warm start, so that sampling at temperature 2 spreads over many tokens."""


def _direct(engine, prompt_ids, *, max_tokens, temperature=0.0, n=1, seed=0):
    """The base's infer path called directly, as the server calls it: (token ids, log-probs) per row."""
    ids = torch.tensor([prompt_ids] * n)
    draws = KeyedDraws(seed, tuple(range(n))) if temperature > 0 else None
    with engine._lock, adapters_disabled(engine.policy.model):
        out = engine.policy.sample(ids, torch.ones_like(ids), max_new_tokens=max_tokens, temperature=temperature,
                                   top_p=1.0, generator=None, draws=draws)
    rows = []
    for r in range(n):
        kept = int(out.completion_mask[r].sum())
        rows.append((out.completion_ids[r, :kept].tolist(), out.logprobs[r, :kept].tolist()))
    return rows


def test_greedy_completion_is_the_infer_path_and_matches_the_train_path(engine, client):
    r = client.completions.create(model="tiny-cpu", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    extra = r.model_extra
    choice = r.choices[0]
    prompt_ids = engine.policy.tokenizer(PROMPT)["input_ids"]
    assert extra["prompt_token_ids"] == prompt_ids
    ids, logps = _direct(engine, prompt_ids, max_tokens=4)[0]
    assert choice.model_extra["token_ids"] == ids and choice.logprobs.token_logprobs == logps
    assert choice.text == engine.policy.tokenizer.decode(ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ids)
    # the top alternatives: 3 per token, best first, the greedy token on top with its own log-prob
    for token, logp, top in zip(choice.logprobs.tokens, logps, choice.logprobs.top_logprobs):
        assert len(top) == 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == logp == max(top.values())
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))

    # the trainer's full-sequence forward scores the same tokens within a few ulps of its logits
    p = torch.tensor([prompt_ids])
    c = torch.tensor([ids])
    with torch.no_grad(), adapters_disabled(engine.policy.model):
        logits = engine.policy.completion_logits(p, torch.ones_like(p), c, torch.ones_like(c), train=False)
    train = torch.log_softmax(logits.float(), -1)[0].gather(-1, c[0][:, None]).squeeze(-1)
    bound = 64 * torch.finfo(logits.dtype).eps * float(logits.abs().max())
    assert (train - torch.tensor(logps)).abs().max().item() <= bound


def test_sampled_completions_follow_the_keyed_draws(engine, client):
    prompt_ids = engine.policy.tokenizer(WILD)["input_ids"]
    r = client.completions.create(model="tiny-cpu", prompt=prompt_ids, max_tokens=6, temperature=2.0, n=4, seed=11,
                                  logprobs=0)
    direct = _direct(engine, prompt_ids, max_tokens=6, temperature=2.0, n=4, seed=11)
    got = [(c.model_extra["token_ids"], c.logprobs.token_logprobs) for c in sorted(r.choices, key=lambda c: c.index)]
    assert got == direct
    assert len({tuple(ids) for ids, _ in direct}) > 1, "four draws at temperature 2 should not all agree"
    # completion j depends on (seed, j) only, not on how many were asked for
    one = client.completions.create(model="tiny-cpu", prompt=prompt_ids, max_tokens=6, temperature=2.0, seed=11)
    assert one.choices[0].model_extra["token_ids"] == direct[0][0]


def test_chat_uses_the_plain_rendering_and_returns_logprobs(engine, client):
    messages = [{"role": "system", "content": "digits"}, {"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model="tiny-cpu", messages=messages, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert not getattr(engine.policy.tokenizer, "chat_template", None)  # the demo tokenizer has none
    rendered = str(ChatPrompt([(m["role"], m["content"]) for m in messages]))
    prompt_ids = engine.policy.tokenizer(rendered)["input_ids"]
    assert r.model_extra["prompt_token_ids"] == prompt_ids
    ids, logps = _direct(engine, prompt_ids, max_tokens=3)[0]
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ids
    content = choice.logprobs.content
    assert [e.logprob for e in content] == logps
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert choice.message.content == engine.policy.tokenizer.decode(ids, skip_special_tokens=True)


def test_streamed_chunks_concatenate_to_the_unstreamed_answer(client):
    args = dict(model="tiny-cpu", prompt=WILD, max_tokens=8, temperature=2.0, n=2, seed=5, logprobs=1)
    whole = client.completions.create(**args)
    texts, ids, logps, finish = {}, {}, {}, {}
    for chunk in client.completions.create(**args, stream=True):
        c = chunk.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        ids[c.index] = ids.get(c.index, []) + c.model_extra["token_ids"]
        logps[c.index] = logps.get(c.index, []) + (c.logprobs.token_logprobs if c.logprobs else [])
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert (texts[c.index], ids[c.index], logps[c.index], finish[c.index]) == (
            c.text, c.model_extra["token_ids"], c.logprobs.token_logprobs, c.finish_reason)

    chat = dict(model="tiny-cpu", messages=[{"role": "user", "content": WILD}], max_tokens=8, temperature=2.0,
                seed=5)
    whole = client.chat.completions.create(**chat)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**chat, stream=True))
    assert streamed == whole.choices[0].message.content


def test_stop_cuts_text_and_tokens(client):
    args = dict(model="tiny-cpu", prompt=WILD, max_tokens=6, temperature=2.0)
    seed, text = next((seed, t) for seed in range(50)
                      if len(t := client.completions.create(**args, seed=seed).choices[0].text) >= 3)
    stop = text[2]
    at = text.find(stop)
    cut = client.completions.create(**args, seed=seed, stop=[stop], logprobs=0).choices[0]
    assert cut.text == text[:at] and cut.finish_reason == "stop"
    assert len(cut.model_extra["token_ids"]) == len(cut.logprobs.token_logprobs) == at  # one character a token


def test_loaded_adapters_change_logprobs_and_swap_in_place(engine, server, client, tmp_path, perturbed_adapter):
    a = perturbed_adapter(tmp_path / "a", 0.5)
    b = perturbed_adapter(tmp_path / "b", 1.0)
    http = httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=60)
    for name, path in (("a", a), ("b", b)):
        assert http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}).status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny-cpu", "a", "b"]

    def scores(model):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
        return r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.top_logprobs

    base, first_a, first_b = scores("tiny-cpu"), scores("a"), scores("b")
    assert first_a != base and first_b != base and first_a != first_b
    assert scores("a") == first_a and scores("tiny-cpu") == base  # swapping back restores each exactly

    again = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": a})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a", prompt=PROMPT, max_tokens=1)
    assert scores("b") == first_b
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "tiny-cpu", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny-cpu", "prompt": [1, 100000]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny-cpu", "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": "tiny-cpu", "prompt": "x", "echo": True}, 422, "echo"),
    ("/v1/completions", {"model": "tiny-cpu", "prompt": "x", "best_of": 2}, 422, "best_of"),
    ("/v1/chat/completions", {"model": "tiny-cpu", "messages": []}, 422, "messages"),
    ("/v1/chat/completions", {"model": "tiny-cpu", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 422, None),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "no-such-adapter"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "/nonexistent"}, 403, "lora_path"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(server.url.removesuffix("/v1") + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and "Traceback" not in r.text


def test_oversized_bodies_unknown_routes_and_a_full_queue_are_refused(engine, server):
    root = server.url.removesuffix("/v1")
    big = httpx.post(root + "/v1/completions", content=b"{" + b" " * (2 << 20) + b"}",
                     headers={"content-type": "application/json"}, timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    garbled = httpx.post(root + "/v1/completions", content=b"not json", headers={"content-type": "application/json"},
                         timeout=60)
    assert garbled.status_code == 422 and garbled.json()["error"]["param"] is None
    missing = httpx.get(root + "/v1/nothing", timeout=60)
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(root + "/health", timeout=60).json() == {"status": "ok"}

    body = {"model": "tiny-cpu", "prompt": "x", "max_tokens": 1}
    waiting = engine.max_waiting
    engine.max_waiting = 0
    try:
        with engine._slot():  # a generation in progress, and no room to wait
            busy = httpx.post(root + "/v1/completions", json=body, timeout=60)
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        assert httpx.post(root + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        engine.max_waiting = waiting
