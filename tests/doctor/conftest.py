"""Fixtures shared by the doctor tests: the saved snapshots and logs under fixtures/."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def snapshots() -> Path:
    return FIXTURES / "snapshots"


@pytest.fixture
def logs() -> Path:
    return FIXTURES / "logs"
