"""Rows whose loss is zero whatever the weights are not run through the update, and the gradient is unchanged."""

import pytest

torch = pytest.importorskip("torch")


def test_micro_batches_keep_their_live_rows_or_one_row():
    from orbitctl.rl.update import micro_rows

    rows = torch.arange(10)
    live = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert [p.tolist() for p in micro_rows(rows, 4, None)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # as many micro-batches as without skipping (DeepSpeed's accumulation and ZeRO's reduction count them)
    assert [p.tolist() for p in micro_rows(rows, 4, live)] == [[1], [4], [8, 9]]
    order = torch.tensor([9, 3, 1, 0])
    assert [p.tolist() for p in micro_rows(order, 2, live)] == [[9], [1]]


def test_rows_are_live_where_a_term_reads_them(small_profile):
    from orbitctl.rl.update import live_rows

    adv = torch.tensor([0.0, 0.0, 1.5, -1.5])
    plain = small_profile(**{"rl.align_loss.kind": "none"}).rl
    assert live_rows(plain, adv).tolist() == [False, False, True, True]
    assert live_rows(small_profile(**{"rl.align_loss.kind": "none", "rl.kl_ref_coef": 0.1}).rl, adv) is None
    assert live_rows(small_profile(**{"rl.align_loss.weight": 0.1}).rl, adv) is None  # the align KL reads every row
    assert live_rows(small_profile(**{"rl.align_loss.weight": 0.0}).rl, adv).tolist() == [False, False, True, True]
