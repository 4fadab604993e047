"""Keyed draws: a row's tokens depend on its key and step, not on the batch it is sampled in."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from orbitctl.model.draws import KeyedDraws, keyed_uniform, splitmix64  # noqa: E402


def test_uniforms_are_deterministic_open_and_spread():
    us = [keyed_uniform(3, key, step) for key in range(200) for step in range(50)]
    assert us == [keyed_uniform(3, key, step) for key in range(200) for step in range(50)]
    assert all(0.0 < u < 1.0 for u in us) and len(set(us)) == len(us)
    assert keyed_uniform(4, 0, 0) != keyed_uniform(3, 0, 0)
    # mean and variance of U(0,1): 1/2 and 1/12, within 5 standard errors of 10,000 draws
    n = len(us)
    mean = sum(us) / n
    assert abs(mean - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(sum((u - mean) ** 2 for u in us) / n - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output of splitmix64 seeded 0


def test_tokens_follow_the_distribution_and_never_a_zero():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 20_000
    draws = KeyedDraws(seed=11, keys=tuple(range(n)))
    tokens = draws.sample(probs.expand(n, -1), step=0)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0
    sigma = (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - n * probs.double()).abs() <= 5 * sigma + 1e-9).all(), counts
    # unnormalised rows (a top-p filtered softmax) give the same tokens as normalised ones
    assert torch.equal(draws.sample(3 * probs.expand(n, -1), step=0), tokens)


def test_a_row_draws_the_same_token_in_any_batch():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(12, 30, generator=g), -1)
    keys = tuple(range(100, 112))
    together = KeyedDraws(5, keys).sample(probs, step=7)
    alone = torch.cat([KeyedDraws(5, (k,)).sample(probs[i:i + 1], step=7) for i, k in enumerate(keys)])
    shuffled = KeyedDraws(5, keys[::-1]).sample(probs.flip(0), step=7).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, shuffled)
    assert not torch.equal(together, KeyedDraws(5, keys).sample(probs, step=8))  # a new step, new draws
    with pytest.raises(ValueError, match="3 rows"):
        KeyedDraws(5, (1, 2)).sample(probs[:3], step=0)


def test_an_offset_seed_draws_from_keys_0_to_n_what_the_run_seed_draws_at_the_prompts_keys():
    """What lets an engine given one prompt's request (keys 0..n-1) sample as the trainer's rollout does."""
    import random

    from orbitctl.model.draws import keyed_uniform, offset_seed, splitmix64, unsplitmix64

    rng = random.Random(0)
    for _ in range(200):
        x = rng.getrandbits(64)
        assert unsplitmix64(splitmix64(x)) == x
    for seed, position, group in ((0, 0, 8), (7, 123, 8), (2**40 + 3, 5, 16), (1, 9, 1)):
        keyed = offset_seed(seed, position * group, group)
        assert keyed is not None
        assert all(keyed_uniform(keyed, k, t) == keyed_uniform(seed, position * group + k, t)
                   for k in range(group) for t in range(4))
    assert offset_seed(0, 5 * 6, 6) is None  # 30 is no multiple of 8: no seed of this form exists
