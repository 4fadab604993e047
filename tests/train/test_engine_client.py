"""The http engine client against a real HTTP server on loopback that answers as a faulty engine would.

Each case scripts the answers of one server (status, body, delay) and checks what the client makes
of them: a retried fault that passes, a fault that outlasts the retries (the error names the URL and
the answer), a refusal that is not retried, and answers that parse but cannot be trained on.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orbitctl.rl.engine_http import EngineFailed, HttpEngine, root_url

VOCAB = 100


def _vllm_answer(rows: int, ids=(5, 6, 2), logprob=-0.5) -> dict:
    return {"choices": [{"index": i, "text": "", "token_ids": list(ids),
                         "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [logprob] * len(ids)}}
                        for i in range(rows)]}


class _Scripted:
    """A loopback server answering each POST with the next scripted (status, body, delay); the last repeats."""

    def __init__(self, script):
        self.script, self.requests, self.headers = list(script), [], []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                owner.requests.append((self.path, json.loads(self.rfile.read(length))))
                owner.headers.append(dict(self.headers))
                status, body, delay = owner.script[min(len(owner.requests), len(owner.script)) - 1]
                time.sleep(delay)
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made = []

    def make(*script):
        server = _Scripted(script)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def _client(url, api="vllm", retries=2, timeout_s=5.0):
    return HttpEngine(url, api, vocab_size=VOCAB, timeout_s=timeout_s, retries=retries, backoff_s=0.01)


def _sample(engine, prompts=([1, 2, 3],), n=2):
    return engine.sample("m", [list(p) for p in prompts], n=n, max_tokens=4, temperature=1.0, top_p=1.0, seed=3)


def test_a_fault_that_passes_on_a_retry_is_retried_and_the_request_is_vllm_shaped(scripted):
    server = scripted((500, {"error": {"message": "engine overloaded"}}, 0), (200, _vllm_answer(4), 0))
    out = _sample(_client(server.url + "/v1"), prompts=([1, 2], [3]), n=2)
    assert [c.ids for c in out] == [[5, 6, 2]] * 4 and out[0].logprobs == [-0.5] * 3
    assert len(server.requests) == 2
    route, body = server.requests[-1]
    assert route == "/v1/completions"
    assert body["prompt"] == [[1, 2], [3]] and body["n"] == 2 and body["logprobs"] == 0
    assert body["return_tokens_as_token_ids"] is True and body["model"] == "m" and body["seed"] == 3


@pytest.mark.parametrize("status, body, needle", [
    (500, {"error": {"message": "CUDA error: an illegal memory access"}}, "HTTP 500: CUDA error"),
    (503, "Service Unavailable", "HTTP 503"),
    (200, "{not json", "not JSON"),
    (200, _vllm_answer(2, ids=(5, 100)), "token id 100 outside the trainer's vocabulary (0..99)"),
    (200, _vllm_answer(1), "2 choices expected, got 1"),
    (200, _vllm_answer(2, logprob=float("nan")), "not a finite number"),
    (200, {"choices": [{"index": 0, "text": "7", "logprobs": {"tokens": ["7"], "token_logprobs": [-1.0]}}] * 2},
     "not named token_id:N"),
])
def test_a_fault_that_outlasts_the_retries_fails_naming_the_url_and_the_answer(scripted, status, body, needle):
    server = scripted((status, body, 0))
    with pytest.raises(EngineFailed) as info:
        _sample(_client(server.url, retries=2))
    message = info.value.render()
    assert f"rollout engine {server.url}/v1/completions" in message and "after 3 attempts" in message
    assert needle in message and "rerun the same command to resume" in message
    assert len(server.requests) == 3


def test_a_refused_request_is_not_retried(scripted):
    server = scripted((400, {"error": {"message": "The model `m` does not exist."}}, 0))
    with pytest.raises(EngineFailed) as info:
        _sample(_client(server.url, retries=3))
    assert "was refused (HTTP 400: The model `m` does not exist.)" in info.value.render()
    assert len(server.requests) == 1


def test_an_adapter_load_the_engine_refuses_fails_the_step(scripted):
    server = scripted((400, {"error": {"message": "lora_path: /x has no adapter_model.safetensors"}}, 0))
    with pytest.raises(EngineFailed) as info:
        _client(server.url).load_adapter("step-3", "/x")
    assert "loading adapter step-3 was refused" in info.value.render()
    assert server.requests[0][0] == "/v1/load_lora_adapter"


def test_a_timeout_and_a_closed_port_are_retried_then_fail(scripted):
    slow = scripted((200, _vllm_answer(2), 1.5))
    with pytest.raises(EngineFailed) as info:
        _sample(_client(slow.url, retries=1, timeout_s=0.3))
    assert "after 2 attempts" in info.value.render() and "timed out" in info.value.render()
    closed = scripted((200, {}, 0))
    url = closed.url
    closed.close()
    with pytest.raises(EngineFailed) as info:
        _sample(_client(url, retries=1))
    assert f"rollout engine {url}/v1/completions" in info.value.render()
    assert "Connection refused" in info.value.render() or "ConnectionRefusedError" in info.value.render()


def test_sglang_native_answers_are_read_from_meta_info(scripted):
    triples = [[-0.25, 7, "7"], [-0.5, 2, None]]
    answer = [{"text": "7", "meta_info": {"output_token_logprobs": triples, "finish_reason": {"type": "stop"}}}] * 2
    server = scripted((200, answer, 0))
    out = _sample(_client(server.url, api="sglang"), n=2)
    assert [c.ids for c in out] == [[7, 2], [7, 2]] and out[1].logprobs == [-0.25, -0.5]
    route, body = server.requests[0]
    assert route == "/generate" and body["input_ids"] == [[1, 2, 3]] and body["lora_path"] == "m"
    assert body["return_logprob"] is True and body["sampling_params"]["n"] == 2
    bad = scripted((200, [{"text": "7", "meta_info": {}}] * 2, 0))
    with pytest.raises(EngineFailed, match="output_token_logprobs"):
        _sample(_client(bad.url, api="sglang", retries=0), n=2)


@pytest.mark.parametrize("entries", [
    [[-0.25, 7, "7"], [-0.5, 2, None]],  # SGLang: [logprob, id, text | null]
    [[-0.25, 7], [-0.5, 2]],  # lmdeploy's SGLang-compatible server: [logprob, id], no text slot
    [[-0.25, 7, "7"], [-0.5, 2]],
], ids=["triples", "pairs", "mixed"])
def test_sglang_logprobs_read_as_triples_or_pairs(scripted, entries):
    answer = [{"text": "7", "meta_info": {"output_token_logprobs": entries, "finish_reason": {"type": "stop"}}}] * 2
    out = _sample(_client(scripted((200, answer, 0)).url, api="sglang"), n=2)
    assert [(c.ids, c.logprobs) for c in out] == [([7, 2], [-0.25, -0.5])] * 2


@pytest.mark.parametrize("entries", [[[-0.25]], [[-0.25, 7, "7", 1]], [[7]]])
def test_sglang_entries_of_another_length_are_refused(scripted, entries):
    answer = [{"text": "7", "meta_info": {"output_token_logprobs": entries}}] * 2
    with pytest.raises(EngineFailed, match=r"\[logprob, id\] pairs"):
        _sample(_client(scripted((200, answer, 0)).url, api="sglang", retries=0), n=2)


def test_the_api_key_is_sent_as_a_bearer_token_and_never_shown(scripted):
    key = "k-7f3a9c"
    server = scripted((200, _vllm_answer(2), 0))
    engine = HttpEngine(server.url, "vllm", vocab_size=VOCAB, timeout_s=5.0, retries=0, api_key=key)
    _sample(engine)
    engine.load_adapter("a", "/x")
    assert [h.get("Authorization") for h in server.headers] == [f"Bearer {key}"] * 2
    assert key not in repr(engine)
    keyless = scripted((200, _vllm_answer(2), 0))
    _sample(_client(keyless.url))
    assert "Authorization" not in keyless.headers[0]


def test_a_refused_key_fails_at_once_naming_the_variable(scripted):
    server = scripted((401, {"error": {"message": "missing or wrong API key"}}, 0))
    engine = HttpEngine(server.url, "vllm", vocab_size=VOCAB, timeout_s=5.0, retries=3, api_key="k-wrong-1")
    with pytest.raises(EngineFailed) as info:
        _sample(engine)
    message = info.value.render()
    assert "HTTP 401" in message and "ORBITCTL_API_KEY" in message and "k-wrong-1" not in message
    assert len(server.requests) == 1


def test_the_url_may_name_the_root_or_the_openai_base():
    assert root_url("http://h:8000") == root_url("http://h:8000/") == root_url("http://h:8000/v1/") == "http://h:8000"
