"""The unbiased pass@k estimator and its interval over tasks.

pass@k of one task with ``n`` samples of which ``c`` pass is the chance that ``k`` samples drawn
without replacement from the ``n`` hold at least one that passes: ``1 - C(n-c, k) / C(n, k)``
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374, eq. 1).
The ratio of binomials is computed as ``prod(1 - k/i for i in n-c+1..n)``, which never forms a
large binomial coefficient. A suite's pass@k is the mean over its tasks.

The interval treats the tasks as the sample (what another suite of the same kind would vary):
* every per-task value 0 or 1 (always so with one sample per task, and so when each task's
  samples all pass or all fail): the mean is a proportion of tasks, so the Wilson score interval
  (Wilson 1927), which stays inside [0, 1] and is not degenerate at 0 or 1 the way the normal
  interval of a proportion is;
* otherwise: the normal interval of the mean of the per-task values, mean +- z * s / sqrt(T)
  with the sample standard deviation ``s`` over the ``T`` tasks (the central-limit interval over
  questions of Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640), clipped to [0, 1];
  the spread of each task's own estimate is part of ``s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

CONFIDENCE = 0.95
"""Coverage of every interval this module reports."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: ``1 - C(n-c, k) / C(n, k)`` for ``c`` passing samples of ``n``."""
    if not 0 <= c <= n:
        raise ValueError(f"passing samples must lie in 0..{n} (got {c})")
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in 1..{n}, the samples drawn (got {k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass(frozen=True)
class Estimate:
    """A suite's pass@k: the mean over tasks and its interval."""

    k: int
    value: float
    low: float
    high: float
    interval: str
    """How the interval was computed: ``wilson`` or ``normal``."""
    tasks: int

    def to_dict(self) -> dict:
        return {"k": self.k, "value": self.value, "low": self.low, "high": self.high, "interval": self.interval,
                "confidence": CONFIDENCE, "tasks": self.tasks}


def _z(confidence: float) -> float:
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``successes / trials``."""
    if trials < 1:
        raise ValueError("the Wilson interval needs at least one trial")
    z = _z(confidence)
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def normal_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """mean +- z * s / sqrt(T) of per-task values in [0, 1], clipped to [0, 1]; one value gives [0, 1]."""
    if not values:
        raise ValueError("the interval needs at least one task")
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return 0.0, 1.0
    var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    half = _z(confidence) * math.sqrt(var / len(values))
    return max(0.0, mean - half), min(1.0, mean + half)


def estimate(counts: list[tuple[int, int]], k: int) -> Estimate:
    """pass@k of a suite from ``(n, c)`` per task (samples, passing samples), with its interval."""
    if not counts:
        raise ValueError("no tasks to estimate pass@k over")
    per_task = [pass_at_k(n, c, k) for n, c in counts]
    value = math.fsum(per_task) / len(per_task)
    if all(v in (0.0, 1.0) for v in per_task):
        low, high = wilson_interval(int(sum(per_task)), len(counts))
        method = "wilson"
    else:
        low, high = normal_interval(per_task)
        method = "normal"
    return Estimate(k, value, low, high, method, len(counts))
