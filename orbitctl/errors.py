"""The OrbitError family and the exit codes every command shares.

Exit codes: 0 ok, 1 a check or run failed, 2 bad usage or bad input.
A user mistake is raised as a subclass of :class:`UserError`; the CLI prints
``Error: <message>`` on one line without a traceback (``ORBITCTL_DEBUG=1`` shows it).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class OrbitError(Exception):
    """Base of every error orbitctl raises on purpose."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def render(self) -> str:
        """One line: what went wrong and, when known, how to fix it."""
        text = self.message.rstrip()
        if self.fix:
            text = f"{text.rstrip('.')}. {self.fix.rstrip()}"
        return text


class UserError(OrbitError):
    """Bad usage or bad input: a file, key or value the user can fix (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class ProfileError(UserError):
    """A profile that does not load or validate; carries every problem found at once."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = [f"{path}: {p}" for p in problems]
        super().__init__("\n".join(lines))

    def render(self) -> str:
        return self.message


class InputFileError(UserError):
    """A data, checkpoint or log file that is missing, truncated or malformed."""


class CheckFailed(OrbitError):
    """A check, gate or run finished and reported failure (exit 1)."""

    exit_code = EXIT_FAILED


class RunFailed(OrbitError):
    """A long-running job (quantize, train) stopped on an error it detected (exit 1)."""

    exit_code = EXIT_FAILED
