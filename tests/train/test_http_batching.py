"""The http rollout's requests: runs of consecutive, keyable positions go out together.

- :func:`keyed_runs` splits a step's positions into the runs one seed can key, as hand-checked here.
- Against `orbitctl serve` over real HTTP on loopback, with a trained-looking adapter hot-loaded and
  prompts of several lengths, sampling a step in those runs returns the token ids and log-probs of
  one request per prompt, row for row, in the number of requests the runs say; and an aligned step
  sent in one request samples what the trainer's own (shared engine) rollout samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orbitctl.data.tasks import PromptItem
from orbitctl.model.draws import offset_seed
from orbitctl.rl.engine_http import HttpEngine, collect_http, keyed_runs, request_seed

DEMO = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml"
SEED = 5
GROUP = 4
# prompts of 4 to 9 characters: the batched requests are left-padded, the per-prompt ones are not
PROMPTS = ["7?M1:", "12+3=", "++M0:", "4*4*4=", "9?", "abc:", "x=1;y=", "31?M2:", "0000:", "5-2=?", "M1:"]


@pytest.mark.parametrize("positions, group, most, runs", [
    (range(0, 8), 8, 32, [(0, 8)]),  # offset 0 keys any run
    (range(32, 64), 8, 32, [(0, 32)]),  # offset 256: runs of up to 256 / 8 prompts
    (range(32, 64), 8, 4, [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4)]),  # the cap
    # G = 4: 3 is at offset 12 (keyable alone), 4 at 16 (a run of up to 4), 8 at 32 (up to 8: the rest)
    (range(3, 12), 4, 8, [(0, 1), (1, 4), (5, 4)]),
    ([3, 4, 5, 6, 7, 9, 10, 11, 20], 4, 4, [(0, 1), (1, 4), (5, 1), (6, 2), (8, 1)]),  # gaps end runs
    ([1, 3, 5, 7], 8, 32, [(0, 1), (1, 1), (2, 1), (3, 1)]),  # every other position (2 ranks): one each
    (range(0, 6), 3, 32, [(0, 6)]),  # G = 3: offset 0 still keys the run
    (range(1, 4), 3, 32, [(0, 1), (1, 1), (2, 1)]),  # offsets 3, 6, 9: not keyable, one request each
    ([], 8, 32, []),
])
def test_keyed_runs_split_positions_into_aligned_consecutive_blocks(positions, group, most, runs):
    got = keyed_runs(list(positions), group, most)
    assert got == runs
    positions = list(positions)
    for first, count in got:  # every run of more than one prompt has a keyed seed
        assert positions[first:first + count] == list(range(positions[first], positions[first] + count))
        assert count == 1 or offset_seed(SEED, positions[first] * group, count * group) is not None


def test_a_request_seed_is_the_keyed_one_or_the_prompts_own():
    keyed = offset_seed(SEED, 16 * 4, 4 * 4)
    assert request_seed(SEED, 16, 4, 4) == (keyed - (1 << 64) if keyed >= 1 << 63 else keyed)
    assert -(1 << 63) <= request_seed(SEED, 3, 4, 1) < 1 << 63  # not keyable: a seed of its own
    assert request_seed(SEED, 3, 4, 1) != request_seed(SEED, 5, 4, 1)
    with pytest.raises(ValueError):
        request_seed(SEED, 3, 4, 2)


@pytest.fixture(scope="module")
def served(model_cache, tmp_path_factory):
    """The demo's serving engine on loopback with a perturbed adapter loaded: (engine, client, adapter name)."""
    from orbitctl.model.adapters import save_adapter
    from orbitctl.profile import load_profile
    from orbitctl.serve.api import build_engine, start_background

    engine = build_engine(load_profile(DEMO))
    directory = tmp_path_factory.mktemp("adapter")
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for _, p in engine.policy.named_trainable():
            p.add_(0.5 * torch.randn(p.shape, generator=g).to(p.dtype))
        save_adapter(engine.policy.model, directory, "lora", engine.policy.hidden_size)
    engine.load_adapter("trained", str(directory))
    server = start_background(engine)
    client = HttpEngine(server.url, "vllm", vocab_size=int(engine.policy.model.config.vocab_size), timeout_s=120,
                        retries=0)
    yield engine, client, "trained"
    server.stop()


def _items(positions):
    return [PromptItem(PROMPTS[p % len(PROMPTS)]) for p in positions]


def _no_reward(texts, _items):
    return [0.0] * len(texts)


def _collect(served, positions, batch_size):
    """collect_http over the prompts at ``positions``; (batch, prompts per request made)."""
    engine, client, model = served
    requests = []
    sample = client.sample

    def counted(model, prompts, **kw):
        requests.append(len(prompts))
        return sample(model, prompts, **kw)

    client.sample = counted
    try:
        batch = collect_http(client, model, engine.policy, _items(positions), _no_reward, group_size=GROUP,
                             batch_size=batch_size, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=SEED,
                             positions=positions)
    finally:
        client.sample = sample
    return batch, requests


def _shared(served, positions, runs):
    """The trainer's own keyed rollout (the shared engine) of the same prompts, one decode per ``(first,
    count)`` run: the rows each run's request decodes, in the same shapes."""
    from orbitctl.rl.rollout import collect

    engine, _, model = served
    rows = []
    with engine._lock, engine._using(model):
        for first, count in runs:
            part = positions[first:first + count]
            rows += _rows(collect(engine.policy, _items(part), _no_reward, group_size=GROUP, batch_size=count * GROUP,
                                  max_new_tokens=3, temperature=1.0, top_p=1.0, generator=None, keep_dist=False,
                                  keys=(SEED, part)))
    return rows


def _rows(batch):
    """``(prompt ids, completion ids, log-probs)`` of each row, without padding."""
    out = []
    for r in range(batch.size):
        k = int(batch.completion_mask[r].sum())
        out.append((batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist(), batch.completion_ids[r, :k].tolist(),
                    batch.infer_logprobs[r, :k].tolist()))
    return out


@pytest.mark.parametrize("positions, batch_size, requests", [
    (list(range(8, 16)), 64, [8]),  # aligned and consecutive: one request
    ([3, 4, 5, 6, 7, 9, 10, 11, 20, 21, 22], 16, [1, 4, 1, 2, 3]),  # unaligned start, gaps, a cap of 4 prompts
])
def test_batched_requests_sample_the_tokens_of_one_request_per_prompt(served, positions, batch_size, requests):
    from orbitctl.kernels.cpu_dtype import compute_dtype_name
    from orbitctl.profile import load_profile

    one_each, singles = _collect(served, positions, GROUP)
    batched, made = _collect(served, positions, batch_size)
    assert singles == [1] * len(positions)
    assert made == requests == [count for _, count in keyed_runs(positions, GROUP, batch_size // GROUP)]
    single, together = _rows(one_each), _rows(batched)
    # the same prompts and tokens, row for row (completion j of prompt i at i * G + j)
    assert [(p, ids) for p, ids, _ in together] == [(p, ids) for p, ids, _ in single]
    assert len({tuple(ids) for _, ids, _ in together}) > 1  # sampled, not one repeated row
    # each request samples, bit for bit, what the trainer's own rollout samples in the same shapes: with
    # prompts of several lengths a batch is left-padded, which moves log-probs by kernel rounding only
    assert together == _shared(served, positions, keyed_runs(positions, GROUP, batch_size // GROUP))
    assert single == _shared(served, positions, [(i, 1) for i in range(len(positions))])
    dtype = torch.bfloat16 if compute_dtype_name(load_profile(DEMO)) == "bf16" else torch.float32
    # a few roundings of a log-prob of magnitude <= 10: a group's prompt is prefilled once, as one row alone and as
    # one left-padded row of several in a request, so the prefill's matmuls differ in shape too (the bound of
    # tests/model/test_shared_prefill.py; fp32 on AVX2 kernels measured 4.1e-5, 34 ulps of 10)
    ulps = 64 * torch.finfo(dtype).eps * 10.0
    worst = max(abs(a - b) for (_, _, la), (_, _, lb) in zip(together, single) for a, b in zip(la, lb))
    assert worst <= ulps, worst
