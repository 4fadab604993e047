"""Fixtures every test directory shares."""

import pytest


def _one_error_line(err: str, *needles: str) -> None:
    """``err`` is exactly one ``Error: ...`` line, no traceback, holding every needle."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def one_error_line():
    """``one_error_line(stderr, *needles)``: a bad-input error printed as one line naming the needles."""
    return _one_error_line
