"""Entropy stability window by window, judged the way ``verify-alignment --run`` judges it.

The gate (``alignment.entropy_fluctuation_max``, 0.05 by default) holds the relative range of the
logged entropy, ``(max - min) / mean``, over every window of ``alignment.entropy_window`` consecutive
logged steps (all of them when the run is shorter). verify-alignment reports only the worst window;
the report needs every window, to draw the band and to say where the entropy first left it, so the
windows are listed here with the same definition (``orbitctl/align/trends.py``; a test holds the two
equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EntropyWindow:
    """One window of consecutive logged entropy values."""

    first_step: int
    last_step: int
    mean: float
    fluctuation: float
    """``(max - min) / mean`` over the window; 0 when every value is equal, inf when the mean is not positive."""


@dataclass
class EntropyJudgement:
    """Every window of a run's entropy against the gate, and the verdict."""

    window: int
    """``alignment.entropy_window``: the steps one window spans."""
    limit: float
    """``alignment.entropy_fluctuation_max``: a window passes when its fluctuation is below it."""
    steps: int
    """Logged steps with an entropy value."""
    windows: list[EntropyWindow]

    @property
    def full_windows(self) -> bool:
        """False when the run logged fewer steps than one window (it is judged on all of them)."""
        return self.steps >= self.window

    @property
    def unstable(self) -> list[EntropyWindow]:
        """The windows whose fluctuation reaches the limit, in step order."""
        return [w for w in self.windows if not w.fluctuation < self.limit]

    @property
    def worst(self) -> EntropyWindow | None:
        return max(self.windows, key=lambda w: w.fluctuation) if self.windows else None

    @property
    def verdict(self) -> str:
        """``stable``, ``unstable`` or ``not logged`` (fewer than two steps with entropy)."""
        if not self.windows:
            return "not logged"
        return "unstable" if self.unstable else "stable"

    def to_dict(self) -> dict:
        worst, unstable = self.worst, self.unstable
        return {"verdict": self.verdict, "window": self.window, "fluctuation_max": self.limit, "steps": self.steps,
                "full_windows": self.full_windows,
                "worst_fluctuation": None if worst is None else worst.fluctuation,
                "worst_window": None if worst is None else [worst.first_step, worst.last_step],
                "unstable_windows": len(unstable),
                "first_unstable_window": [unstable[0].first_step, unstable[0].last_step] if unstable else None,
                "left_band_at_step": unstable[0].last_step if unstable else None}


def judge_entropy(series: list[tuple[int, float]], window: int, limit: float) -> EntropyJudgement:
    """Every window of ``min(window, len(series))`` consecutive ``(step, entropy)`` values, judged against ``limit``."""
    values = [v for _, v in series]
    if len(values) < 2:
        return EntropyJudgement(window, limit, len(values), [])
    width = min(window, len(values))
    windows = []
    for first in range(len(values) - width + 1):
        chosen = values[first:first + width]
        mean = math.fsum(chosen) / width
        windows.append(EntropyWindow(series[first][0], series[first + width - 1][0], mean,
                                     _relative_range(max(chosen), min(chosen), mean)))
    return EntropyJudgement(window, limit, len(values), windows)


def _relative_range(high: float, low: float, mean: float) -> float:
    if high == low:
        return 0.0
    return (high - low) / mean if mean > 0 else math.inf
