"""What the doctor reports: one Finding per check or log signature, gathered in a Report.

Statuses, from worst to best: FAIL (broken; exit 1), WARN (works, but slow or fragile),
UNKNOWN (could not see: no permission, unreadable), INFO (a fact worth showing), PASS, SKIP
(not applicable here, e.g. no GPU). A probe that could not run never yields PASS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, WARN, FAIL, SKIP, UNKNOWN, INFO = "PASS", "WARN", "FAIL", "SKIP", "UNKNOWN", "INFO"
STATUSES = (FAIL, WARN, UNKNOWN, INFO, PASS, SKIP)
SEVERITY = {s: i for i, s in enumerate(reversed(STATUSES))}  # higher is worse

AREAS = ("log", "training run", "GPU", "topology", "NCCL", "memory", "host")
"""Every area a finding can belong to, in the order a report shows them (the log's story first)."""
BRIEF = (PASS, SKIP)
"""Statuses whose first evidence line says it all; the others show every line."""
NO_GPU_SKIP = "no_gpu"
"""``Finding.data["skip_reason"]`` of a check SKIPped because no GPU is visible: a report says that once (its notes
carry NVML's detail and the fix), not once per check."""


@dataclass
class Finding:
    """One verdict: a stable id, a status, the evidence it rests on and the exact fix."""

    id: str
    area: str
    status: str
    title: str
    evidence: list[str] = field(default_factory=list)
    fix: str | None = None
    rank: int | None = None
    """Distributed rank the finding is attributed to (log findings), when known."""
    data: dict[str, Any] = field(default_factory=dict)
    """Parsed numbers behind the verdict (e.g. OOM sizes, watchdog SeqNum) for --json readers."""

    def __post_init__(self) -> None:
        if self.area not in AREAS:
            raise ValueError(f"finding {self.id}: unknown area {self.area!r} (one of {', '.join(AREAS)})")

    @property
    def shown_evidence(self) -> list[str]:
        """The evidence worth showing: the first line of a PASS or SKIP, every line of the rest."""
        return self.evidence[:1] if self.status in BRIEF else list(self.evidence)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def worst(statuses: list[str]) -> str:
    """The most severe status in a list (PASS when empty)."""
    return max(statuses, key=lambda s: SEVERITY[s], default=PASS)


@dataclass
class Report:
    """Everything one `orbitctl doctor` run found."""

    findings: list[Finding] = field(default_factory=list)
    root_cause: Finding | None = None
    """The log finding ranked first: the failure the others follow from."""
    notes: list[str] = field(default_factory=list)
    """One-line headlines for the person at the terminal (e.g. no NVIDIA driver found)."""
    snapshot_source: str | None = None
    log_source: str | None = None
    isa: list[dict[str, Any]] | None = None
    """The machine's ISA table (orbitctl.doctor.isa: feature, cpu, os, detail, errno per row); None when no machine
    was checked, [] when the snapshot has none."""

    @property
    def failed(self) -> bool:
        return any(f.status == FAIL for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    @property
    def verdict(self) -> str:
        """FAILED when any finding is FAIL, else OK."""
        return "FAILED" if self.failed else "OK"

    def failed_ids(self) -> list[str]:
        return [f.id for f in self.findings if f.status == FAIL]

    def by_area(self, *, without_no_gpu_skips: bool = False) -> list[tuple[str, list[Finding]]]:
        """(area, its findings) in AREAS order, areas without findings left out; an area AREAS lacks comes last.
        ``without_no_gpu_skips``: leave out the checks :meth:`no_gpu_skips` lists (a note says it once)."""
        hidden = {id(f) for f in self.no_gpu_skips()} if without_no_gpu_skips else set()
        shown = [f for f in self.findings if id(f) not in hidden]
        areas = list(AREAS) + sorted({f.area for f in shown} - set(AREAS))
        grouped = [(area, [f for f in shown if f.area == area]) for area in areas]
        return [(area, rows) for area, rows in grouped if rows]

    def no_gpu_skips(self) -> list[Finding]:
        """The checks SKIPped because no GPU is visible (:data:`NO_GPU_SKIP`, env.nvml among them)."""
        return [f for f in self.findings if f.status == SKIP and f.data.get("skip_reason") == NO_GPU_SKIP]

    def by_id(self, check_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == check_id), None)

    def ids_with(self, status: str) -> set[str]:
        return {f.id for f in self.findings if f.status == status}

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for f in self.findings if f.status == s) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": not self.failed,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "notes": list(self.notes),
            "snapshot": self.snapshot_source,
            "log": self.log_source,
            "root_cause": self.root_cause.to_dict() if self.root_cause else None,
            "isa": self.isa,
            "findings": [f.to_dict() for f in self.findings],
        }
