"""``env:guess``: find a hidden digit from higher/lower feedback, small enough for the tiny CPU model.

The seed hides a digit 0-9. The first observation is ``G:``; each action is one digit. A wrong guess
is answered ``H:`` (the digit is higher) or ``L:`` (lower), anything that is not one digit ``?:``;
the right digit ends the episode with reward 1. Bisection finds any digit in 4 guesses; 4 guesses at
random win a third of the episodes (1 - 0.9^4), so the feedback is worth learning to read.
"""

from __future__ import annotations

import random
from typing import ClassVar

from orbitctl.rl.envs.base import Environment


class GuessDigit(Environment):
    """Higher/lower search over one hidden digit."""

    name: ClassVar[str] = "guess"
    turn_limit: ClassVar[int] = 4
    seed_pool: ClassVar[int] = 1000

    def __init__(self) -> None:
        self.target: int | None = None
        self.done = True

    def reset(self, seed: int) -> str:
        self.target = random.Random(seed).randrange(10)
        self.done = False
        return "G:"

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset() first")
        guess = action.strip()
        if len(guess) != 1 or not guess.isdigit():
            return "?:", 0.0, False
        if int(guess) == self.target:
            self.done = True
            return "=", 1.0, True
        return ("H:" if self.target > int(guess) else "L:"), 0.0, False
