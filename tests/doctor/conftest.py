from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def snapshots() -> Path:
    return FIXTURES / "snapshots"


@pytest.fixture
def logs() -> Path:
    return FIXTURES / "logs"
