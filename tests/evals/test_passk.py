"""The pass@k estimator against hand-computed values and brute-force enumeration, and its intervals."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from orbitctl.evals.passk import estimate, normal_interval, pass_at_k, wilson_interval


@pytest.mark.parametrize("n, c, k, expected", [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (10, 3, 1, 0.3),                      # pass@1 is c / n
    (5, 2, 2, 1 - 3 / 10),                # C(3,2) / C(5,2) = 3 / 10
    (10, 1, 10, 1.0),                     # k = n: any passing sample is drawn
    (10, 0, 10, 0.0),
    (6, 1, 3, 1 - 10 / 20),               # C(5,3) / C(6,3) = 10 / 20
    (20, 5, 10, 1 - 3003 / 184756),       # C(15,10) / C(20,10)
])
def test_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_matches_enumeration_over_subsets():
    # pass@k is the share of k-subsets of the n samples holding at least one that passes
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, rel=1e-12, abs=1e-15), (n, c, k)


def test_stable_where_binomials_are_huge():
    # C(200, 100) overflows a float; the product form needs no binomial at all
    exact = 1 - math.comb(195, 100) / math.comb(200, 100)
    assert pass_at_k(200, 5, 100) == pytest.approx(exact, rel=1e-12)


def test_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_suite_value_is_the_mean_over_tasks():
    counts = [(10, 0), (10, 3), (10, 10), (10, 7)]
    for k in (1, 5, 10):
        got = estimate(counts, k)
        assert got.value == pytest.approx(sum(pass_at_k(n, c, k) for n, c in counts) / 4)
        assert got.low <= got.value <= got.high and got.tasks == 4
        # at k = n every task either holds a passing sample (1) or not (0): a proportion of tasks
        assert got.interval == ("wilson" if k == 10 else "normal")


def test_wilson_for_one_sample_per_task():
    got = estimate([(1, 1)] * 7 + [(1, 0)] * 3, 1)
    assert got.interval == "wilson" and got.value == pytest.approx(0.7)
    assert (got.low, got.high) == pytest.approx(wilson_interval(7, 10))
    # the textbook value of the 95% Wilson interval of 7/10 (z = 1.96): 0.3968 .. 0.8922
    assert got.low == pytest.approx(0.3968, abs=1e-4) and got.high == pytest.approx(0.8922, abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and 0.6 < low < 1.0   # not degenerate at a perfect score


def test_wilson_where_every_task_all_passes_or_all_fails():
    # ten samples each, none passing: a normal interval would collapse to [0, 0]
    got = estimate([(10, 0)] * 4, 1)
    assert got.value == 0.0 and got.interval == "wilson" and got.low == 0.0 and got.high > 0.3
    assert estimate([(10, 10), (10, 0)], 5).interval == "wilson"
    assert estimate([(10, 10), (10, 3)], 1).interval == "normal"


def test_normal_interval_covers_the_true_mean_about_95_percent():
    rng = random.Random(0)
    truth = [rng.random() for _ in range(50)]
    mean = sum(truth) / len(truth)
    hits, trials = 0, 400
    for _ in range(trials):
        draws = [truth[rng.randrange(len(truth))] for _ in range(40)]
        low, high = normal_interval(draws)
        hits += low <= mean <= high
    # 400 trials of a 95% interval: the binomial spread puts the count well inside 0.90..0.99
    assert 0.90 <= hits / trials <= 0.99, hits


def test_normal_interval_of_one_task_is_uninformative():
    assert normal_interval([0.4]) == (0.0, 1.0)
