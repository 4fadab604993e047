"""The distribution distances on hand-checked cases."""

import math

import torch

from orbitctl.distances import entropy, js_divergence, kl_divergence, logsoftmax_l1, topk_agreement


def test_identical_distributions_are_at_distance_zero():
    logp = torch.log_softmax(torch.randn(3, 5, 17), -1)
    assert torch.allclose(js_divergence(logp, logp), torch.zeros(3, 5), atol=1e-7)
    assert torch.equal(logsoftmax_l1(logp, logp), torch.zeros(3, 5))
    assert torch.equal(topk_agreement(logp, logp, k=3), torch.ones(3, 5))


def test_disjoint_supports_reach_ln2():
    a = torch.log(torch.tensor([[1.0, 0.0]]).clamp_min(1e-30))
    b = torch.log(torch.tensor([[0.0, 1.0]]).clamp_min(1e-30))
    assert abs(js_divergence(a, b).item() - math.log(2.0)) < 1e-6


def test_js_matches_the_definition_on_a_small_case():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.1, 0.6, 0.3])
    m = (p + q) / 2
    expected = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    got = js_divergence(p.log(), q.log())
    assert abs(got.item() - expected.item()) < 1e-6
    assert abs(kl_divergence(p.log(), q.log()).item() - (p * (p / q).log()).sum().item()) < 1e-6


def test_l1_entropy_and_topk_on_known_values():
    a = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    b = torch.log(torch.tensor([0.2, 0.7, 0.1]))
    assert abs(logsoftmax_l1(a, b).item() - 2 * abs(math.log(0.7 / 0.2)) / 3) < 1e-6
    assert topk_agreement(a, b, k=1).item() == 0.0
    assert topk_agreement(a, b, k=2).item() == 1.0
    uniform = torch.full((4,), math.log(0.25))
    assert abs(entropy(uniform).item() - math.log(4)) < 1e-6
