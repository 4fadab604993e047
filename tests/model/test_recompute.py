"""memory.keep_frozen_outputs: the checkpointed layers' recompute keeps the frozen matmuls' outputs instead of running
them again: the same gradients, fewer matmuls in the backward, and the plan counts what it keeps."""

from __future__ import annotations

import pytest
import torch

from orbitctl.plan.recompute import checkpoint_kwargs, keeps


def _enable(policy, keep: bool) -> None:
    policy.model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(keep_frozen_outputs=keep))


def _step(policy, split):
    """Adapter gradients of one loss over a batch of two prompts' completions, and the ops its backward dispatched."""
    from orbitctl.rl.steptime import dispatched_ops

    policy.model.zero_grad(set_to_none=True)
    ids, mask = policy.encode_prompts([it.prompt for it in split.train[:2]])
    completion = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = policy.completion_logits(ids, mask, completion, torch.ones_like(completion))
    loss = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None]).mean()
    ops = dispatched_ops(torch, loss.backward)
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    return grads, ops


def test_the_gradients_are_full_recomputes_bit_for_bit_with_fewer_matmuls_in_the_backward(profile_policy):
    policy, split, _ = profile_policy("tiny-cpu.yaml", **{"quant.format": "int4", "memory.keep_frozen_outputs": "true"})
    # the profile's key reaches every checkpointed layer's checkpoint call
    layers = [m for m in policy.model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and all("context_fn" in m._gradient_checkpointing_func.keywords for m in layers)
    kept, kept_ops = _step(policy, split)
    _enable(policy, keep=False)
    full, full_ops = _step(policy, split)
    assert kept.keys() == full.keys() and all(torch.equal(kept[n], full[n]) for n in full)
    assert any(g.abs().sum() > 0 for g in full.values())
    matmuls = ("mm", "addmm", "bmm", "int4_bf16_mm", "_weight_int4pack_mm_for_cpu")
    fewer = sum(kept_ops.get(op, 0) for op in matmuls)
    assert fewer < sum(full_ops.get(op, 0) for op in matmuls)


def test_only_matmuls_against_weights_without_gradients_are_kept():
    x = torch.randn(4, 8, requires_grad=True)
    frozen, adapter = torch.randn(8, 3), torch.randn(8, 3, requires_grad=True)
    assert keeps(torch.ops.aten.mm.default, (x, frozen))
    assert not keeps(torch.ops.aten.mm.default, (x, adapter))
    assert keeps(torch.ops.aten.addmm.default, (torch.zeros(3), x, frozen))
    assert not keeps(torch.ops.aten.mul.Tensor, (x, x))


def test_the_key_needs_checkpointing_and_is_not_combined_with_activation_offload():
    from pydantic import ValidationError

    from orbitctl.profile.schema import MemorySection

    with pytest.raises(ValidationError, match="needs memory.gradient_checkpointing"):
        MemorySection(keep_frozen_outputs=True, gradient_checkpointing=False)
    with pytest.raises(ValidationError, match="offload_activations"):
        MemorySection(keep_frozen_outputs=True, offload_activations="cpu")


def test_the_plan_counts_the_kept_outputs_and_a_recompute_without_the_frozen_matmuls():
    from pathlib import Path

    from orbitctl.plan import _arch, apply_changes, plan_profile
    from orbitctl.plan.activations import frozen_outputs
    from orbitctl.plan.measure import settings_for
    from orbitctl.profile import load_profile

    profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu.yaml")
    full, kept = (plan_profile(apply_changes(profile, {"memory.keep_frozen_outputs": keep}), with_advice=False)
                  for keep in (False, True))
    arch = _arch(profile)
    per_token = sum(frozen_outputs(arch, layer, settings_for(profile)) for layer in arch.layers)
    tokens = profile.memory.micro_batch_size * profile.memory.seq_len
    extra = kept.phases["policy_update"]["activations"] - full.phases["policy_update"]["activations"]
    # every reached layer's outputs, less the one being recomputed (counted among its saved tensors already)
    assert 0 < extra <= per_token * tokens
    assert kept.timing.phases["policy_update"].seconds < full.timing.phases["policy_update"].seconds


def test_the_output_layer_reads_a_contiguous_input_whatever_positions_are_kept(profile_policy):
    """transformers slices the kept positions out of the hidden states; a strided 3-D input would make the output
    layer's matmul copy its weight once per row ([B, H, V]) in the forward and again in the backward."""
    policy, split, _ = profile_policy("tiny-cpu.yaml")
    seen = []
    handle = policy.output_layer.register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    try:
        ids, mask = policy.encode_prompts([it.prompt for it in split.train[:2]])
        completion = torch.randint(3, 40, (2, 3), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = policy.completion_logits(ids, mask, completion, torch.ones_like(completion))
    finally:
        handle.remove()
    assert seen == [True] and logits.shape[:2] == (2, 3)
