"""A prompt that several rows share (a GRPO group) is prefilled once and its KV cache copied to each row.

The sampler must give every row what it gives the row alone: the same tokens, log-probs within the bound the
compute dtype sets, and on an MoE the same recorded routing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from orbitctl.model.draws import KeyedDraws  # noqa: E402
from orbitctl.model.policy import shared_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_shared_prompts_finds_the_first_row_of_each_prompt_in_order():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1]] * 2 + [[1, 1, 1]] + [[0, 1, 1]] + [[1, 1, 1]])
    unique, rows = shared_prompts(ids, mask)
    assert unique.tolist() == [0, 2] and rows.tolist() == [0, 0, 1, 0, 1]
    assert torch.equal(ids[unique][rows], ids) and torch.equal(mask[unique][rows], mask)
    # the same ids with another padding are another prompt; all rows distinct: nothing to share
    other = mask.clone()
    other[1, 0] = 1
    assert shared_prompts(ids, other)[1].tolist() == [0, 1, 2, 0, 2]
    assert shared_prompts(ids[1:3], mask[1:3]) == (None, None)


def _policy(name: str, tmp_path_factory, **sets):
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts
    from orbitctl.profile import load_profile

    profile = load_profile(ROOT / "profiles" / name,
                           [f"run.dir={tmp_path_factory.mktemp('run')}", *(f"{k}={v}" for k, v in sets.items())])
    split = load_prompts(profile.data, profile.run.seed)
    return load_policy(profile, prepare_frozen_base(profile, split.warm_task)), split


@pytest.mark.parametrize("name, kv", [("tiny-cpu.yaml", "bf16"), ("tiny-moe-cpu.yaml", "bf16"),
                                      ("tiny-moe-cpu.yaml", "fp8")])
def test_a_group_prefilled_once_samples_what_each_row_samples_alone(name, kv, tmp_path_factory, model_cache,
                                                                    monkeypatch):
    from orbitctl.model import policy as policy_module

    policy, split = _policy(name, tmp_path_factory, **{"rollout.kv_dtype": kv})
    items = split.train[:3]
    prompts = [items[i].prompt for i in (0, 0, 1, 0, 2, 1, 2, 2)]
    ids, mask = policy.encode_prompts(prompts)
    keys = tuple(range(len(prompts)))
    widths = []
    hook = policy.model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        together = policy.sample(ids, mask, max_new_tokens=6, temperature=1.0, top_p=1.0, generator=None,
                                 draws=KeyedDraws(3, keys), keep_dist=True)
    finally:
        hook.remove()
    assert widths[0][0] == 3, widths[0]  # the prefill ran the three distinct prompts
    assert all(w[0] == len(prompts) and w[1] == 1 for w in widths[1:])  # every decode step ran every row
    # the floor, measured here: the same eight rows each prefilled on its own (nothing shared), against each row alone
    with monkeypatch.context() as patch:
        patch.setattr(policy_module, "shared_prompts", lambda ids, mask: (None, None))
        unshared = policy.sample(ids, mask, max_new_tokens=6, temperature=1.0, top_p=1.0, generator=None,
                                 draws=KeyedDraws(3, keys), keep_dist=True)
    alone, apart, floor = [], [], 0.0
    for row, key in enumerate(keys):
        one = policy.sample(ids[row:row + 1], mask[row:row + 1], max_new_tokens=6, temperature=1.0, top_p=1.0,
                            generator=None, draws=KeyedDraws(3, (key,)), keep_dist=True)
        width = one.completion_ids.shape[1]
        for batch in (together, unshared):
            assert torch.equal(batch.completion_ids[row, :width], one.completion_ids[0])
            assert torch.equal(batch.completion_mask[row, :width], one.completion_mask[0])
            assert not batch.completion_mask[row, width:].any()
        kept = one.completion_mask[0].bool()
        alone.append(one)
        apart.append((together.dist[row, :width][kept] - one.dist[0][kept]).abs().max())
        floor = max(floor, float((unshared.dist[row, :width][kept] - one.dist[0][kept]).abs().max()))
    # one row and eight rows take different matmul blockings: a few roundings of the compute dtype apart, or, with
    # the fp8 cache, what a cached value rounded to the next e4m3 step does (seen under the AVX2 cap in fp32: 1e-3),
    # which the floor shows
    bound = 64 * torch.finfo(policy.model.get_input_embeddings().weight.dtype).eps
    for row, one in enumerate(alone):
        kept = one.completion_mask[0].bool()
        assert apart[row] <= max(4 * floor, bound * (1 + one.dist[0][kept].abs().max())), (row, apart[row], floor)
        if policy.routing is not None:
            width = one.completion_ids.shape[1]
            assert torch.equal(together.prompt_routes[row], one.prompt_routes[0])
            assert torch.equal(together.routes[row, :width], one.routes[0])
