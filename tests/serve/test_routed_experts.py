"""`orbitctl serve` returns each sequence's routed experts as SGLang does (``return_routed_experts``).

Over real HTTP on loopback, the tiny MoE profile's server answers ``/generate`` with
``meta_info.routed_experts``: base64 of little-endian int32, (token, MoE layer, slot) order, over every token
of the sequence but the last. Its prompt rows are the infer path's prefill routing without the left padding,
its completion rows the routing :meth:`Policy.sample` records for the same prompts and draws. Without the
flag there is no such key; a dense base refuses the flag (400).
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "profiles" / "tiny-moe-cpu.yaml"
ONE_PROCESS = ["memory.expert_parallel=1", "hardware.gpus_per_node=1"]
PROMPTS = ["12+3=", "7?", "x=1;y="]  # several lengths: the batch is left-padded
SEED = 9


@pytest.fixture(scope="module")
def moe_server(model_cache):
    """The tiny MoE profile's engine on one process, served on loopback: (engine, root URL)."""
    from orbitctl.profile import load_profile
    from orbitctl.serve.api import build_engine, start_background

    engine = build_engine(load_profile(MOE, ONE_PROCESS))
    server = start_background(engine)
    yield engine, server.url.removesuffix("/v1")
    server.stop()


def _prompt_ids(policy) -> list[list[int]]:
    ids, mask = policy.encode_prompts(PROMPTS)
    return [ids[r][mask[r].bool()].tolist() for r in range(len(PROMPTS))]


def _generate(root: str, prompts, **extra):
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "n": 2, "sampling_seed": SEED}, **extra}
    return httpx.post(root + "/generate", json=body, timeout=120)


def _decoded(payload: str, layers: int, top_k: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(payload), dtype="<i4").reshape(-1, layers, top_k).copy())


def test_generate_returns_the_prompts_and_completions_routing_as_the_infer_path_records_it(moe_server):
    from orbitctl.model.adapters import adapters_disabled
    from orbitctl.model.draws import KeyedDraws

    engine, root = moe_server
    policy = engine.policy
    layers, top_k = policy.routing.layers, policy.routing.top_k
    prompts = _prompt_ids(policy)
    answer = _generate(root, prompts, return_routed_experts=True)
    assert answer.status_code == 200, answer.text
    results = answer.json()
    assert len(results) == len(prompts) * 2
    # the same left-padded batch and keyed draws on the infer path, called directly
    rows = [p for p in prompts for _ in range(2)]
    width = max(map(len, rows))
    ids = torch.tensor([[policy.pad_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with engine._lock, adapters_disabled(policy.model):
        out = policy.sample(ids, mask, max_new_tokens=5, temperature=1.0, top_p=1.0, generator=None,
                            draws=KeyedDraws(SEED, tuple(range(len(rows)))))
    for r, result in enumerate(results):
        tokens = int(out.completion_mask[r].sum())
        assert result["output_ids"] == out.completion_ids[r, :tokens].tolist()
        prompt = len(rows[r])
        routed = _decoded(result["meta_info"]["routed_experts"], layers, top_k)
        assert routed.shape == (prompt + tokens - 1, layers, top_k)  # every token but the last
        assert torch.equal(routed[:prompt], out.prompt_routes[r][mask[r].bool()].long())
        assert torch.equal(routed[prompt:], out.routes[r, :tokens - 1].long())
        assert ((routed >= 0) & (routed < policy.model.config.n_routed_experts)).all()
    # the payloads are each sequence's own, not one routing repeated
    assert len({result["meta_info"]["routed_experts"] for result in results}) > 1


def test_without_the_flag_there_is_no_routing(moe_server):
    engine, root = moe_server
    answer = _generate(root, _prompt_ids(engine.policy)[:1])
    assert answer.status_code == 200, answer.text
    results = answer.json()
    assert len(results) == 2 and all("routed_experts" not in r["meta_info"] for r in results)


def test_a_dense_base_refuses_the_flag(engine, server):
    root = server.url.removesuffix("/v1")
    assert engine.policy.routing is None
    answer = _generate(root, [[1, 43, 45, 26]], return_routed_experts=True)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "return_routed_experts" and "dense" in error["message"]
    assert _generate(root, [[1, 43, 45, 26]]).status_code == 200  # the same request without it is served
