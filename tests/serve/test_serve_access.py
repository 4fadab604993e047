"""`orbitctl serve` at its edges: the API key on every route, the adapter fence, request limits, malformed requests.

Two more servers over the session's engine, on loopback threads: ``keyed`` (a key, adapter loading fenced to
one directory, small limits) and ``locked`` (a key, adapter loading off). Every check goes over real HTTP;
the fence is checked by what it answers and by what the process opened while answering (an audit hook
records every ``open``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from orbitctl.errors import UserError
from orbitctl.serve.api import Access, start_background
from orbitctl.serve.security import AdapterFence, Limits, check_exposure, is_loopback

KEY = "test-key-5b1f0e"
GOOD = {"Authorization": f"Bearer {KEY}"}
ROOT = Path(__file__).resolve().parents[2]
LIMITS = Limits(max_prompt_tokens=40, max_tokens=4, max_n=3, max_batch=4)
OPENED: list[str] = []
_RECORDING: list[bool] = []


def _audit(event, args):
    if event == "open" and _RECORDING and isinstance(args[0], (str, bytes)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(adapter root, a directory beside it that the fence must keep out)."""
    return tmp_path_factory.mktemp("adapter-root"), tmp_path_factory.mktemp("outside")


@pytest.fixture(scope="module")
def keyed(engine, dirs):
    running = start_background(engine, access=Access(KEY, AdapterFence(True, dirs[0]), LIMITS))
    yield running.url.removesuffix("/v1")
    running.stop()


@pytest.fixture(scope="module")
def locked(engine):
    running = start_background(engine, access=Access(KEY))
    yield running.url.removesuffix("/v1")
    running.stop()


COMPLETION = {"model": "tiny-cpu", "prompt": "+-M5:", "max_tokens": 2, "temperature": 0}
ROUTES = [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"model": "tiny-cpu", "messages": [{"role": "user", "content": "1+1"}],
                                      "max_tokens": 2, "temperature": 0}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("POST", "/generate", {"input_ids": [1, 43, 45], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}),
    ("POST", "/unload_lora_adapter", {"lora_name": "x"}),
    ("GET", "/v1/no-such-route", None),
]


def _call(root, method, path, body=None, headers=None):
    return httpx.request(method, root + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}],
                         ids=["none", "wrong", "no-scheme", "basic", "longer"])
@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_but_health_needs_the_key(keyed, method, path, body, headers):
    r = _call(keyed, method, path, body, headers)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
    assert KEY not in r.text


def test_the_right_key_is_served_and_health_stays_open(keyed, engine, dirs, perturbed_adapter):
    assert _call(keyed, "GET", "/health").json() == {"status": "ok"}
    for method, path, body in ROUTES[:3] + ROUTES[5:6]:
        assert _call(keyed, method, path, body, GOOD).status_code == 200, path
    adapter = perturbed_adapter(dirs[0] / "step-1", 0.5)
    assert _call(keyed, "POST", "/v1/load_lora_adapter", {"lora_name": "s1", "lora_path": adapter}, GOOD).status_code == 200
    assert _call(keyed, "POST", "/v1/unload_lora_adapter", {"lora_name": "s1"}, GOOD).status_code == 200
    # a path relative to the root names a directory under it
    assert _call(keyed, "POST", "/load_lora_adapter", {"lora_name": "s1", "lora_path": "step-1"}, GOOD).json()[
        "loaded_adapters"] == {"s1": str(dirs[0].resolve() / "step-1")}
    assert _call(keyed, "POST", "/unload_lora_adapter", {"lora_name": "s1"}, GOOD).status_code == 200


def test_adapter_loading_is_off_without_the_flag(locked, dirs, perturbed_adapter):
    adapter = perturbed_adapter(dirs[0] / "off", 0.5)
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "o", "lora_path": adapter}),
                       ("/load_lora_adapter", {"lora_name": "o", "lora_path": adapter}),
                       ("/v1/unload_lora_adapter", {"lora_name": "o"}), ("/unload_lora_adapter", {"lora_name": "o"})):
        r = _call(locked, "POST", path, body, GOOD)
        assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_loading_disabled", (path, r.text)
        assert "--allow-adapter-loading" in r.json()["error"]["message"]
    assert [m["id"] for m in _call(locked, "GET", "/v1/models", headers=GOOD).json()["data"]] == ["tiny-cpu"]


def test_the_fence_refuses_paths_leaving_the_root_and_opens_nothing_outside(keyed, engine, dirs, perturbed_adapter):
    root, outside = dirs
    target = Path(perturbed_adapter(outside / "adapter", 0.5))  # a valid adapter: only the fence stands in the way
    (root / "link").symlink_to(target, target_is_directory=True)
    (root / "inner").mkdir()
    (root / "inner" / "adapter_model.safetensors").symlink_to(target / "adapter_model.safetensors")
    attempts = [str(target), str(root / ".." / outside.name / "adapter"), f"../{outside.name}/adapter",
                str(root / "link"), "link", str(root / "inner"), "inner"]
    before = [m["id"] for m in _call(keyed, "GET", "/v1/models", headers=GOOD).json()["data"]]
    OPENED.clear()
    _RECORDING.append(True)
    try:
        answers = [_call(keyed, "POST", route, {"lora_name": f"n{i}", "lora_path": path}, GOOD)
                   for i, path in enumerate(attempts) for route in ("/v1/load_lora_adapter", "/load_lora_adapter")]
    finally:
        _RECORDING.clear()
    for r in answers:
        assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path", r.text
        assert r.json()["error"]["code"] == "adapter_path_forbidden"
    assert any("'..'" in r.json()["error"]["message"] for r in answers)
    outside_real = os.path.realpath(outside)
    assert not [p for p in OPENED if os.path.realpath(p).startswith(outside_real)], OPENED
    assert [m["id"] for m in _call(keyed, "GET", "/v1/models", headers=GOOD).json()["data"]] == before


@pytest.mark.parametrize("path, body, param, flag", [
    ("/v1/completions", {**COMPLETION, "prompt": "x" * 50}, "prompt", "--max-prompt-tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 5}, "max_tokens", "--max-tokens"),
    ("/v1/completions", {**COMPLETION, "n": 4}, "n", "--max-n"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 43], [1, 45]], "n": 3}, "prompt", "--max-batch"),
    ("/v1/chat/completions", {"model": "tiny-cpu", "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 9}, "max_completion_tokens", "--max-tokens"),
    ("/generate", {"input_ids": [1, 43], "sampling_params": {"max_new_tokens": 5}}, "sampling_params.max_new_tokens",
     "--max-tokens"),
    ("/generate", {"input_ids": [[1, 43]] * 2, "sampling_params": {"n": 3}}, "input_ids", "--max-batch"),
])
def test_requests_over_a_limit_get_400_naming_it(keyed, path, body, param, flag):
    r = _call(keyed, "POST", path, body, GOOD)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "limit_exceeded" and flag in error["message"]


def test_a_length_left_to_its_default_stops_at_the_token_limit(keyed):
    chat = {"model": "tiny-cpu", "messages": [{"role": "user", "content": "q"}], "temperature": 2.0, "seed": 3}
    completion = {"model": "tiny-cpu", "prompt": "q", "temperature": 2.0, "seed": 3}  # OpenAI's default: 16
    generate = {"input_ids": [1, 43], "sampling_params": {"temperature": 2.0, "sampling_seed": 3}}  # SGLang's: 128
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        r = _call(keyed, "POST", path, body, GOOD)
        assert r.status_code == 200 and 0 < r.json()["usage"]["completion_tokens"] <= LIMITS.max_tokens, r.text
    r = _call(keyed, "POST", "/generate", generate, GOOD)
    assert r.status_code == 200 and 0 < len(r.json()["output_ids"]) <= LIMITS.max_tokens, r.text


MALFORMED = [
    b"not json", b"{", b"[]", b"null", b'"text"', b"{}",
    b'{"model": "tiny-cpu", "prompt": 5}', b'{"model": "tiny-cpu", "prompt": "x", "n": "two"}',
    b'{"model": "tiny-cpu", "prompt": "x", "temperature": "hot"}', b'{"model": 7, "prompt": "x"}',
    b'{"model": "tiny-cpu", "prompt": "x", "max_tokens": 1000000000000000000000000000000}',
    b'{"model": "tiny-cpu", "prompt": "x", "n": 1000000000000000000000000000000}',
    b'{"model": "tiny-cpu", "prompt": "x", "seed": 1000000000000000000000000000000}',
    b'{"model": "tiny-cpu", "prompt": "x", "temperature": 1e308}',
    b'{"model": "tiny-cpu", "prompt": [1000000000000000000000000000000]}',
    b'{"model": "tiny-cpu", "prompt": [-1, 2]}', b'{"model": "tiny-cpu", "prompt": []}',
    b'{"model": "tiny-cpu", "prompt": "x", "max_tokens": -1}', b'{"model": "no-such-model", "prompt": "x"}',
    b'{"model": "tiny-cpu", "prompt": "x", "stop": ["", "", "", "", ""]}',
    b'{"model": "tiny-cpu", "prompt": "x", "logprobs": 1000}',
]


def test_malformed_requests_get_4xx_and_the_server_stays_up(keyed):
    for raw in MALFORMED:
        r = httpx.post(keyed + "/v1/completions", content=raw, timeout=60,
                       headers={**GOOD, "content-type": "application/json"})
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    chat = httpx.post(keyed + "/v1/chat/completions", json={"model": "tiny-cpu", "messages": "hi"}, headers=GOOD,
                      timeout=60)
    assert chat.status_code == 422
    big = httpx.post(keyed + "/v1/completions", content=b"{" + b" " * (2 << 20) + b"}", timeout=60,
                     headers={**GOOD, "content-type": "application/json"})
    assert big.status_code == 413
    assert _call(keyed, "GET", "/health").status_code == 200
    assert _call(keyed, "POST", "/v1/completions", COMPLETION, GOOD).status_code == 200


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("example.org", False)])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback
    if loopback:
        check_exposure(host, None)
    else:
        with pytest.raises(UserError) as info:
            check_exposure(host, None)
        assert "ORBITCTL_API_KEY" in info.value.render()
    check_exposure(host, KEY)


def _serve_cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "ORBITCTL_API_KEY"}
    return subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "serve", "profiles/tiny-cpu.yaml", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("args, needles", [
    (["--host", "0.0.0.0"], ["--host 0.0.0.0", "ORBITCTL_API_KEY"]),
    (["--allow-adapter-loading"], ["--allow-adapter-loading", "--adapter-root"]),
    (["--adapter-root", "."], ["--adapter-root", "--allow-adapter-loading"]),
    (["--allow-adapter-loading", "--adapter-root", "no/such/dir"], ["--adapter-root no/such/dir"]),
    (["--api-key", " "], ["empty"]),
])
def test_unsafe_or_inert_options_exit_2_before_anything_loads(args, needles, one_error_line):
    done = _serve_cli(*args)
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, *needles)
