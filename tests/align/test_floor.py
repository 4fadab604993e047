"""The kernel floor: the one-ulp dtype bound holds, jumps must clear the floor, forced decoding replays samples."""

from __future__ import annotations

import math

import pytest
import torch

from orbitctl.align.floor import KernelFloor, clear_of_floor, dtype_bound, dtype_eps, floor_from_table
from orbitctl.align.selfcheck import LayerError, first_jump
from orbitctl.align.metrics import token_metrics
from orbitctl.align.tokens import TokenTable


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eps_is_torch_finfo(dtype):
    assert dtype_eps(str(dtype)) == torch.finfo(dtype).eps


@pytest.mark.parametrize("seed", range(5))
def test_logits_within_delta_stay_inside_the_bound(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = 6.0 * torch.randn(64, 100, generator=generator, dtype=torch.float64)
    absmax = float(logits.abs().max())
    bound = dtype_bound("bfloat16", absmax, ulps=4.0)
    delta = bound["delta_logit"]
    # the worst case for the bound: every entry moved by +-delta (a range of 2 delta)
    signs = torch.randint(0, 2, logits.shape, generator=generator, dtype=torch.float64) * 2 - 1
    moved = logits + delta * signs
    sampled = torch.randint(0, 100, (64,), generator=generator)
    m = token_metrics(logits, moved, sampled)
    assert float(m["js"].max()) <= bound["js"]
    assert float(m["sampled_dlogp_abs"].max()) <= bound["sampled_dlogp_abs"]
    assert float(m["logsoftmax_l1"].max()) <= bound["logsoftmax_l1"]
    # and the bound is not vacuous: the worst case reaches a good part of it
    assert float(m["js"].max()) > 0.05 * bound["js"]


def test_floor_ratio_and_summary():
    table = TokenTable(k=2)
    logits = torch.randn(8, 10, generator=torch.Generator().manual_seed(0))
    table.add(logits, logits + 1e-3 * torch.randn(8, 10, generator=torch.Generator().manual_seed(1)))
    floor = floor_from_table(table, measured_as="a test", compute_dtype="float32",
                             logit_absmax=float(logits.abs().max()))
    assert set(floor.summary) == set(table.summary()) and not floor.is_the_comparison
    comparison = {"js": {"mean": 10 * floor.summary["js"]["mean"]}}
    assert floor.times(comparison, "js") == pytest.approx(10.0)
    zero = KernelFloor("x", "bfloat16", {"js": {"mean": 0.0, "max": 0.0}}, 1.0)
    assert zero.times({"js": {"mean": 0.0}}, "js") == 1.0 and math.isinf(zero.times({"js": {"mean": 1e-9}}, "js"))
    assert floor.to_dict()["dtype_bound_1ulp"]["js"] == dtype_bound("float32", floor.logit_absmax)["js"]


def test_a_jump_must_stand_clear_of_the_layer_floor():
    errors = [LayerError(0, "embeddings", 0.0), LayerError(1, "layers.0", 0.02), LayerError(2, "layers.1", 0.3)]
    assert first_jump(errors).name == "layers.0"
    # where layers.0's same-weights error is 0.01, 0.02 is only 2x the floor: not the jump
    assert first_jump(errors, kernel_floor=[0.0, 0.01, 0.01]).name == "layers.1"
    assert first_jump(errors, kernel_floor=[0.0, 0.01, 0.1]) is None
    assert clear_of_floor(1.0, None) and clear_of_floor(1.0, 0.1) and not clear_of_floor(0.9, 0.1)


def test_forced_decoding_replays_the_samplers_own_tokens(align_profile):
    """Teacher-forcing a sampler's tokens through the same model and batch gives its logits back:
    the same kernels on the same shapes, so equal by construction on any machine."""
    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    _, profile = align_profile()
    split = load_prompts(profile.data, 0)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    prompts = [item.prompt for item in split.eval[:6]]
    ids, mask = policy.encode_prompts(prompts)
    samples = policy.sample(ids, mask, max_new_tokens=4, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(3), keep_logits=True)
    forced = policy.sample(ids, mask, max_new_tokens=0, temperature=1.0, top_p=1.0, generator=None,
                           keep_logits=True, forced=(samples.completion_ids, samples.completion_mask))
    assert torch.equal(forced.completion_ids, samples.completion_ids)
    assert torch.equal(forced.completion_mask, samples.completion_mask)
    keep = samples.completion_mask.bool()
    assert torch.equal(forced.logits[keep], samples.logits[keep])
