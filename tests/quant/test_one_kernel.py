"""The frozen base computes the same numbers, and the same gradients, whether or not a no-grad
(infer-path) forward ran first: one kernel for the infer and the train path."""

import pytest
import torch

from orbitctl.model.frozen_base import load_frozen_base


def _train_forward(model, ids):
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits.float()
    logits.square().mean().backward()
    return logits.detach(), embeds.grad


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_infer_forward_does_not_change_the_train_path(quantized, fmt):
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(3))
    fresh = load_frozen_base(quantized("llama", fmt))
    logits_fresh, grad_fresh = _train_forward(fresh, ids)

    served = load_frozen_base(quantized("llama", fmt))
    with torch.no_grad():  # the infer path runs first, as in a rollout
        infer = served(ids).logits.float()
    logits_served, grad_served = _train_forward(served, ids)

    assert torch.equal(infer, logits_served)
    assert torch.equal(logits_fresh, logits_served)
    # a repacked CPU kernel without autograd would drop the gradient through every quantized layer
    assert torch.allclose(grad_fresh, grad_served, rtol=1e-3, atol=1e-6)
