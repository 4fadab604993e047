"""A log finding under construction: the events of one signature (or rule), their evidence, fix and data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orbitctl.doctor.logscan import Event


@dataclass
class Group:
    id: str
    title: str
    severity: str
    priority: int
    fix: str
    events: list[Event] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    """Set when a rule explains this group by another one (shown as WARN 'seen during ...')."""

    @property
    def first_line(self) -> int:
        return self.events[0].line_no

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events if e.rank is not None})


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    from orbitctl.doctor.sysfs import format_cpulist

    return format_cpulist(values)
