"""adapter.last_layers in the plan: adapters, activations and the update's backward cover the adapted layers only."""

from __future__ import annotations

import pytest

from orbitctl.errors import UserError
from orbitctl.plan import _arch, plan_profile
from orbitctl.plan.adapters import plan_adapters
from orbitctl.plan.timing import backward_reach

LLAMA = dict(model={"arch": "llama-3.1-8b"}, adapter={"rank": 16, "targets": "all-linear"},
             memory={"micro_batch_size": 4, "seq_len": 1024, "gradient_checkpointing": True})


def _profile(make_profile, **adapter):
    return make_profile(**{**LLAMA, "adapter": {**LLAMA["adapter"], **adapter}})


def test_every_layer_named_is_the_same_plan_as_none(make_profile):
    full, every = _profile(make_profile), _profile(make_profile, last_layers=32)
    a, b = plan_profile(full, with_advice=False), plan_profile(every, with_advice=False)
    assert a.per_gpu_bytes == b.per_gpu_bytes and a.timing.seconds == b.timing.seconds


def test_the_adapters_are_the_last_layers_share(make_profile):
    arch = _arch(_profile(make_profile))
    full = plan_adapters(arch, _profile(make_profile).adapter)
    last = plan_adapters(arch, _profile(make_profile, last_layers=8).adapter)
    assert last.first_layer == 24 and {i for i, _ in last.adapted} == set(range(24, 32))
    assert last.trainable_params * 4 == full.trainable_params  # identical layers: 8 of 32


def test_the_update_keeps_and_runs_less_below_the_first_adapted_layer(make_profile):
    full = plan_profile(_profile(make_profile), with_advice=False)
    last = plan_profile(_profile(make_profile, last_layers=8), with_advice=False)
    # checkpointed: one layer input kept per layer the backward reaches, 8 of 32 here
    assert last.per_gpu_bytes["activations"] < full.per_gpu_bytes["activations"]
    update_full, update_last = (p.timing.phases["policy_update"] for p in (full, last))
    rollout_full, rollout_last = (p.timing.phases["rollout"] for p in (full, last))
    assert rollout_last.flops < rollout_full.flops  # fewer adapters in the forward
    # the forward is the same; the backward's and recompute's base matmuls shrink by the reach
    arch = _arch(_profile(make_profile))
    reach = backward_reach(arch, 24)
    # the last 8 layers, the final norm and the output layer: all but the embedding and the first 24 layers
    below = sum(w.numel for layer in arch.layers[:24] for w in layer.weights)
    assert reach == pytest.approx((arch.params_total - arch.embedding.numel - below) / arch.params_total, rel=1e-12)
    assert 8 / 32 < reach < 8 / 32 + arch.lm_head.numel / arch.params_total
    assert update_last.flops < 0.6 * update_full.flops


def test_more_layers_than_the_model_has_is_refused(make_profile):
    with pytest.raises(UserError, match="adapter.last_layers: 33, and llama-3.1-8b has 32 decoder layers"):
        plan_profile(_profile(make_profile, last_layers=33), with_advice=False)
