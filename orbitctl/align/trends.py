"""A training run's metrics.jsonl, judged for alignment: entropy stability and mismatch trends.

``train`` appends one JSON object per optimizer step to ``runs/<name>/metrics.jsonl`` (fields in
docs/train.md). A run killed mid-write leaves a torn last line; it is skipped. Fields may be null (e.g.
``entropy`` on a step whose update was skipped); such values are left out of the statistics.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from orbitctl.errors import InputFileError, UserError
from orbitctl.rundir import RunDir, metric_series as _series

MISMATCH_PREFIX = "mismatch_"


@dataclass
class EntropyStability:
    """The largest relative entropy fluctuation over every window of ``window`` consecutive logged steps."""

    window: int
    steps: int                      # logged steps with an entropy value
    worst_fluctuation: float        # (max − min) / mean of entropy over the worst window
    worst_window: tuple[int, int]   # first and last step of that window
    full_windows: bool              # False when the run has fewer steps than the window (judged on all steps)


def entropy_stability(records: list[dict], window: int, *, source: str = RunDir.METRICS) -> EntropyStability:
    """Slide a ``window``-step window over the logged entropy; O(n) with monotonic queues."""
    if window < 2:
        raise UserError(f"alignment.entropy_window: must be >= 2 (got {window}) — fix: set it in the profile")
    series = _series(records, "entropy")
    if not series:
        raise InputFileError(f"{source}: no entropy field in any record (entropy) — fix: pass the metrics of a "
                             f"training run (orbitctl train logs entropy every step)")
    if len(series) < 2:
        raise InputFileError(f"{source}: {len(series)} step with entropy; stability needs at least 2 — fix: train "
                             f"for more steps (alignment.entropy_window = {window})")
    steps = [s for s, _ in series]
    values = [v for _, v in series]
    width = min(window, len(values))
    highs: deque[int] = deque()
    lows: deque[int] = deque()
    total = 0.0
    worst, worst_at = -1.0, 0
    for i, value in enumerate(values):
        while highs and values[highs[-1]] <= value:
            highs.pop()
        highs.append(i)
        while lows and values[lows[-1]] >= value:
            lows.pop()
        lows.append(i)
        total += value
        first = i - width + 1
        if first < 0:
            continue
        if first > 0:
            total -= values[first - 1]
        while highs[0] < first:
            highs.popleft()
        while lows[0] < first:
            lows.popleft()
        fluctuation = _relative_range(values[highs[0]], values[lows[0]], total / width)
        if fluctuation > worst:
            worst, worst_at = fluctuation, first
    # recompute the winner exactly: a running sum drifts over thousands of steps
    chosen = values[worst_at:worst_at + width]
    worst = _relative_range(max(chosen), min(chosen), math.fsum(chosen) / width)
    return EntropyStability(window, len(values), worst, (steps[worst_at], steps[worst_at + width - 1]),
                            len(values) >= window)


def _relative_range(high: float, low: float, mean: float) -> float:
    if high == low:
        return 0.0
    return (high - low) / mean if mean > 0 else math.inf


@dataclass
class MismatchTrend:
    """How one online train/infer mismatch metric moved over the run."""

    metric: str
    first: float                 # mean over the first 10% of its steps (at least one)
    last: float                  # mean over the last 10%
    max: float
    slope_per_100_steps: float   # least-squares slope against the step number, times 100
    n: int                       # steps with a value


def mismatch_trends(records: list[dict], *, source: str = RunDir.METRICS) -> list[MismatchTrend]:
    """One trend per ``mismatch_*`` field the run logged with at least two values, in field order."""
    if len(records) < 2:
        raise InputFileError(f"{source}: {len(records)} step(s) logged; a trend needs at least 2 — fix: train "
                             f"for more steps")
    names = list(dict.fromkeys(k for r in records for k in r if k.startswith(MISMATCH_PREFIX)))
    trends = []
    for name in names:
        series = _series(records, name)
        if len(series) < 2:
            continue
        values = [v for _, v in series]
        edge = max(1, len(values) // 10)
        trends.append(MismatchTrend(name, math.fsum(values[:edge]) / edge, math.fsum(values[-edge:]) / edge,
                                    max(values), 100.0 * _slope(series), len(values)))
    return trends


def _slope(series: list[tuple[int, float]]) -> float:
    n = len(series)
    mean_x = math.fsum(s for s, _ in series) / n
    mean_y = math.fsum(v for _, v in series) / n
    spread = math.fsum((s - mean_x) ** 2 for s, _ in series)
    if spread == 0:
        return 0.0
    return math.fsum((s - mean_x) * (v - mean_y) for s, v in series) / spread
