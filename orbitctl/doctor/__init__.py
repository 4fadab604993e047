"""orbitctl doctor: probe the machine into a Snapshot, check it, and triage a failed run's log.

    from orbitctl.doctor import diagnose, take_snapshot, run_checks, triage_log
    report = diagnose(log="train.log", profile_path="profiles/x.yaml")
    report.root_cause, report.exit_code

The functions live in ``orbitctl.doctor.api`` (the command's entry point) and are re-exported
here; patch them there (``orbitctl.doctor.api.take_snapshot``), where ``diagnose`` looks them up.
"""

from __future__ import annotations

from orbitctl.doctor.api import check_ids, diagnose, read_log, run_checks, take_snapshot, triage_log
from orbitctl.doctor.findings import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, Finding, Report
from orbitctl.doctor.snapshot import Snapshot, load_snapshot, save_snapshot

__all__ = [
    "FAIL", "INFO", "PASS", "SKIP", "UNKNOWN", "WARN", "Finding", "Report", "Snapshot",
    "check_ids", "diagnose", "load_snapshot", "read_log", "run_checks", "save_snapshot", "take_snapshot", "triage_log",
]
