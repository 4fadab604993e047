"""Fixtures for the planner tests: the repository root and profiles built in code."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _make_profile(**sections):
    from orbitctl.profile.loader import validate_profile

    data = {"name": "test", "model": {"arch": "llama-3.1-8b"}, **sections}
    return validate_profile(data, "test")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def make_profile():
    """make_profile(model={'arch': 'kimi-k2'}, memory={...}) -> a validated Profile."""
    return _make_profile


@pytest.fixture
def kimi_b200():
    from orbitctl.profile import load_profile

    return load_profile(REPO / "profiles" / "kimi-k2_grpo_int4_8xb200.yaml")
