"""`orbitctl report`: PNG figures, summary.json and a one-page summary.md of one or more training runs.

    from orbitctl.report import write_report
    report = write_report(["runs/tiny-cpu"])               # runs/tiny-cpu/report/
    report.files, report.document["runs"][0]["entropy"]

Reads only what a run directory holds (metrics.jsonl, profile.yaml, summary.json) and plans the run's
profile for the memory it predicted; no torch. docs/report.md describes each figure and field.
"""

from orbitctl.report.api import Report, build_summary, report_dir, write_report

__all__ = ["Report", "build_summary", "report_dir", "write_report"]
