"""The update's arithmetic against values computed by hand."""

import math

import pytest

torch = pytest.importorskip("torch")

from orbitctl.distances import entropy
from orbitctl.rl.losses import group_advantages, is_correction, k3, kl_full, mismatch_stats, ppo_clip_terms


def test_group_advantages_std_normalised_and_not():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, std_normalize=True, eps=1e-4)
    # group 1: mean 0.5, population std 0.5 -> 0.5 / (0.5 + eps); group 2: all equal -> 0
    s = 0.5 / 0.5001
    assert adv.tolist() == pytest.approx([s, -s, -s, s, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
    raw = group_advantages(rewards, group_size=4, std_normalize=False)
    assert raw.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])


def test_group_advantages_groups_are_consecutive_rows():
    rewards = torch.tensor([3.0, 1.0, 10.0, 30.0])
    adv = group_advantages(rewards, group_size=2, std_normalize=False)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -10.0, 10.0])


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))
    adv = torch.tensor([1.0])
    loss, clipped, ratio = ppo_clip_terms(logp, old, adv, clip_eps=0.2)
    # A>0: min(r, clip(r)) -> 1.2 (clipped), 0.5 (unclipped is smaller), 1.1, 1.2
    assert (-loss).tolist()[0] == pytest.approx([1.2, 0.5, 1.1, 1.2], rel=1e-6)
    assert clipped.tolist()[0] == [1.0, 0.0, 0.0, 1.0]
    assert ratio.tolist()[0] == pytest.approx([1.5, 0.5, 1.1, 1.5], rel=1e-6)
    neg, _, _ = ppo_clip_terms(logp, old, torch.tensor([-2.0]), clip_eps=0.2)
    # A<0: min(-2r, -2clip(r)) -> -3.0, -1.6 (clipped at 0.8), -2.2, -3.0
    assert (-neg).tolist()[0] == pytest.approx([-3.0, -1.6, -2.2, -3.0], rel=1e-6)


def test_ppo_clip_gradient_zero_where_clipped():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_(True)
    loss, _, _ = ppo_clip_terms(logp, old, torch.tensor([1.0]), clip_eps=0.2)
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.0])


def test_tis_truncates_at_cap():
    old = torch.log(torch.tensor([[0.5, 0.3, 0.9]]))
    infer = torch.log(torch.tensor([[0.1, 0.3, 0.6]]))
    out = is_correction(old, infer, "tis", cap=2.0)
    assert out.ratio.tolist()[0] == pytest.approx([5.0, 1.0, 1.5], rel=1e-5)
    assert out.weight.tolist()[0] == pytest.approx([2.0, 1.0, 1.5], rel=1e-5)
    assert out.clipped.tolist()[0] == [1.0, 0.0, 0.0]


def test_icepop_masks_outside_band():
    old = torch.log(torch.tensor([[0.5, 0.3, 0.9, 0.05]]))
    infer = torch.log(torch.tensor([[0.1, 0.3, 0.6, 0.5]]))
    out = is_correction(old, infer, "icepop", low=0.5, high=4.0)
    # ratios 5.0 (above), 1.0, 1.5, 0.1 (below)
    assert out.weight.tolist()[0] == pytest.approx([0.0, 1.0, 1.5, 0.0], rel=1e-5)
    assert out.clipped.tolist()[0] == [1.0, 0.0, 0.0, 1.0]
    none = is_correction(old, infer, "none")
    assert none.weight.tolist()[0] == [1.0, 1.0, 1.0, 1.0]


def test_align_kl_full_distribution_by_hand():
    p = torch.tensor([[[0.5, 0.25, 0.25]]])
    q = torch.tensor([[[0.25, 0.25, 0.5]]])
    kl = kl_full(p.log(), q.log())
    expected = 0.5 * math.log(2.0) + 0.25 * math.log(0.5)
    assert kl.item() == pytest.approx(expected, rel=1e-6)
    assert kl_full(p.log(), p.log()).item() == pytest.approx(0.0, abs=1e-7)


def test_align_kl_gradient_reaches_train_side_only():
    train = torch.log(torch.tensor([[[0.6, 0.4]]])).requires_grad_(True)
    infer = torch.log(torch.tensor([[[0.5, 0.5]]])).requires_grad_(True)
    kl_full(train, infer).sum().backward()
    assert train.grad is not None and infer.grad is None


def test_k3_by_hand():
    logp = torch.log(torch.tensor([0.5]))
    other = torch.log(torch.tensor([0.25]))
    # d = log(0.25/0.5) = -log 2: exp(d) - d - 1 = 0.5 + log 2 - 1
    assert k3(logp, other).item() == pytest.approx(0.5 + math.log(2.0) - 1.0, rel=1e-6)
    assert k3(logp, logp).item() == 0.0


def test_entropy_and_mismatch_stats():
    uniform = torch.full((1, 1, 4), 0.25).log()
    assert entropy(uniform).item() == pytest.approx(math.log(4.0), rel=1e-6)
    train = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    infer = torch.log(torch.tensor([[0.4, 0.2, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    stats = mismatch_stats(train, infer, mask)
    assert stats["mismatch_logp_abs_max"] == pytest.approx(math.log(1.25), rel=1e-5)
    assert stats["mismatch_logp_abs_mean"] == pytest.approx(math.log(1.25) / 2, rel=1e-5)
    assert stats["mismatch_prob_abs_mean"] == pytest.approx(0.05, rel=1e-5)
    d = math.log(0.4 / 0.5)
    assert stats["mismatch_k3_kl"] == pytest.approx((math.exp(d) - d - 1) / 2, rel=1e-5)
