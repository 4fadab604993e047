"""Router replay over the http rollout: the experts an SGLang-protocol engine returns are the ones the update runs.

- :func:`parse_routed_experts` reads SGLang's ``meta_info.routed_experts`` (base64 of little-endian int32 over
  the prompt and the completion but its last token) into the completion's ``[T, L, k]``, the last token -1; a
  payload that is missing, not base64 or of the wrong length is retried, naming the field and the SGLang flag.
- Against `orbitctl serve` over real HTTP on loopback, with the tiny MoE profile on one process,
  :func:`collect_http` gives the batch the routing the trainer's own (shared engine) rollout records for the
  same keyed draws, and the train path replays exactly those experts.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from orbitctl.data.tasks import PromptItem
from orbitctl.rl.engine_http import HttpEngine, _Retry, collect_http, parse_routed_experts

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "profiles" / "tiny-moe-cpu.yaml"
ONE_PROCESS = ["memory.expert_parallel=1", "hardware.gpus_per_node=1"]
PROMPTS = ["12+3=", "7?", "x=1;y=", "4*4*4="]  # several lengths: the request's batch is left-padded
SEED = 5
GROUP = 4


def _payload(experts: np.ndarray) -> str:
    return base64.b64encode(experts.astype("<i4").tobytes()).decode()


def test_an_sglang_payload_becomes_the_completions_routing():
    prompt, tokens, layers, top_k = 3, 4, 2, 2
    experts = np.arange((prompt + tokens - 1) * layers * top_k, dtype=np.int32).reshape(-1, layers, top_k) % 8
    routes = parse_routed_experts(_payload(experts), prompt, tokens, layers, top_k)
    assert routes.dtype == torch.int16 and routes.shape == (tokens, layers, top_k)
    assert torch.equal(routes[:tokens - 1], torch.from_numpy(experts[prompt:]).to(torch.int16))
    assert (routes[tokens - 1] == -1).all()  # the last token was never fed back: no routing
    # through the client's parse of a whole answer: result i * n + j follows prompt i's length
    client = HttpEngine("http://127.0.0.1:1", "sglang", vocab_size=100, timeout_s=1, retries=0)
    answer = [{"meta_info": {"output_token_logprobs": [[-0.5, 7, "x"]] * tokens,
                             "routed_experts": _payload(experts if p == prompt else experts[1:])}}
              for p in (prompt, prompt - 1)]
    parsed = client._sglang(answer, 2, [prompt, prompt - 1], (layers, top_k))
    assert torch.equal(parsed[0].routes, routes) and torch.equal(parsed[1].routes, routes)


@pytest.mark.parametrize("payload, says", [
    (_payload(np.zeros((3 + 4 - 1) * 2 * 2 - 1, np.int32)), "expected"),  # one int32 short
    (_payload(np.zeros((3 + 4) * 2 * 2, np.int32)), "expected"),  # the last token's row included
    ("not base64!", "not base64"),
    (None, "without"),
])
def test_a_wrong_payload_is_retried_naming_the_field_and_the_flag(payload, says):
    with pytest.raises(_Retry) as caught:
        parse_routed_experts(payload, 3, 4, 2, 2)
    assert "meta_info.routed_experts" in caught.value.answer and says in caught.value.answer
    assert "--enable-return-routed-experts" in caught.value.answer


def test_the_vllm_protocol_has_no_routed_experts():
    client = HttpEngine("http://127.0.0.1:1", "vllm", vocab_size=100, timeout_s=1, retries=0)
    with pytest.raises(ValueError, match="sglang"):
        client.sample("m", [[1, 2]], n=1, max_tokens=1, temperature=0.0, top_p=1.0, seed=0, routed_experts=(2, 2))


@pytest.fixture(scope="module")
def moe_served(model_cache):
    """The tiny MoE profile's engine on one process, served on loopback: (engine, SGLang-protocol client)."""
    from orbitctl.profile import load_profile
    from orbitctl.serve.api import build_engine, start_background

    engine = build_engine(load_profile(MOE, ONE_PROCESS))
    server = start_background(engine)
    client = HttpEngine(server.url, "sglang", vocab_size=int(engine.policy.model.config.vocab_size), timeout_s=120,
                        retries=0)
    yield engine, client
    server.stop()


def _no_reward(texts, _items):
    return [0.0] * len(texts)


def test_the_http_rollout_carries_the_engines_routing_and_the_update_replays_it(moe_served):
    from orbitctl.rl.rollout import collect

    engine, client = moe_served
    policy = engine.policy
    items, positions = [PromptItem(p) for p in PROMPTS], list(range(len(PROMPTS)))
    kw = dict(group_size=GROUP, batch_size=len(PROMPTS) * GROUP, max_new_tokens=4, temperature=1.0, top_p=1.0)
    assert not policy.router_replay  # without rl.router_replay the engine is not asked for its routing
    plain = collect_http(client, engine.base_name, policy, items, _no_reward, seed=SEED, positions=positions, **kw)
    assert plain.routes is None
    policy.router_replay = True
    try:
        batch = collect_http(client, engine.base_name, policy, items, _no_reward, seed=SEED, positions=positions, **kw)
    finally:
        policy.router_replay = False
    assert torch.equal(batch.completion_ids, plain.completion_ids)
    with engine._lock, engine._using(engine.base_name):  # the trainer's own rollout of the same keyed draws
        shared = collect(policy, items, _no_reward, generator=None, keep_dist=False, keys=(SEED, positions), **kw)
    assert torch.equal(batch.completion_ids, shared.completion_ids)
    assert torch.equal(batch.completion_mask, shared.completion_mask)
    B, T = batch.completion_ids.shape
    assert batch.routes.shape == shared.routes.shape == (B, T, policy.routing.layers, policy.routing.top_k)
    # the engine returns no routing for a row's last token (SGLang's format); the shared engine recorded it
    # where the row ended before the batch did (its EOS was fed back), which no loss reads
    last = batch.completion_mask.sum(-1) - 1
    expected = shared.routes.clone()
    expected[torch.arange(B), last] = -1
    assert torch.equal(batch.routes, expected)
    recorded = (batch.routes >= 0).all(-1).all(-1)
    assert recorded.sum() >= B  # every row's tokens but its last, and there are such tokens

    prompt = batch.prompt_ids.shape[1]
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    with engine._lock, engine._using(engine.base_name), torch.no_grad():
        policy.completion_logits(*args, routes=batch.routes, replay=True)
        for layer, ran in enumerate(policy.routing.replayed):
            ran = ran.reshape(B, prompt + T, -1)[:, prompt:].cpu()
            assert torch.equal(ran[recorded], batch.routes[:, :, layer].long()[recorded])
        # the rows line up with the tokens: the train path's own routing agrees with them better than with the
        # same routing one token later
        policy.completion_logits(*args, routes=batch.routes, replay=False)
        aligned = policy.routing_agreement(batch.routes, prompt, batch.completion_mask).overall
        shifted = batch.routes.clone()
        shifted[:, 1:] = batch.routes[:, :-1]
        shifted[:, 0] = -1
        policy.completion_logits(*args, routes=shifted, replay=False)
        later = policy.routing_agreement(shifted, prompt, batch.completion_mask).overall
    assert aligned > later, (aligned, later)
