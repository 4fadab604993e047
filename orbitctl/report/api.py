"""``orbitctl report``: draw one or more training runs and write the report directory in one piece.

    report = write_report(["runs/tiny-cpu"])                                  # runs/tiny-cpu/report/
    report = write_report(["runs/one-node", "runs/two-nodes"], out="reports/nodes")
    report.out, report.files, report.document["runs"][0]["entropy"]["verdict"]

The directory is filled under a temporary name and renamed into place when every file is written
(``orbitctl.rundir.atomic_dir``), so an interrupted report leaves the previous one, or none, never
one that looks complete. Several runs need ``out``: their comparison belongs to none of them, and
writing it into the first run's ``report/`` would replace that run's own report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orbitctl.errors import UserError
from orbitctl.report.figures import figures_for, save
from orbitctl.report.markdown import render_markdown
from orbitctl.report.runs import ReportRun, load_runs
from orbitctl.report.summary import run_summary
from orbitctl.rundir import RunDir, atomic_dir, atomic_write_json, atomic_write_text, read_json_or_none

FORMAT = "orbitctl-report"
"""summary.json's ``format``: how a directory is known to be a report that may be replaced."""
VERSION = 1


@dataclass
class Report:
    """What ``write_report`` wrote."""

    out: Path
    document: dict
    """summary.json."""
    files: list[str]
    """File names inside ``out``, figures first."""

    def to_dict(self) -> dict:
        return {"out": str(self.out), "files": self.files, **self.document}


def report_dir(run_dirs: list[str | Path], out: str | Path | None) -> Path:
    """Where the report goes: ``out``, else the only run's ``report/``; refuses a place it would destroy."""
    if out is None:
        if len(run_dirs) != 1:
            raise UserError(f"--out: {len(run_dirs)} runs need an output directory",
                            fix="add --out DIR, e.g. --out reports/comparison (one run defaults to RUN_DIR/report)")
        return RunDir(run_dirs[0]).report
    target = Path(out)
    resolved = target.resolve()
    for run in run_dirs:
        root = Path(run).resolve()
        if resolved == root or resolved in root.parents:
            raise UserError(f"--out {out}: is the run directory {run} or holds it; the report replaces its directory",
                            fix="pick a new directory, e.g. --out reports/comparison")
    if target.exists() and not target.is_dir():
        raise UserError(f"--out {out}: is a file", fix="pick a directory")
    if target.is_dir() and any(target.iterdir()) and not _is_report(target):
        raise UserError(f"--out {out}: exists and holds files that are not a report; the report replaces its directory",
                        fix="pick a new or empty directory")
    return target


def _is_report(path: Path) -> bool:
    document = read_json_or_none(path / "summary.json")
    return isinstance(document, dict) and document.get("format") == FORMAT


def write_report(run_dirs: list[str | Path], out: str | Path | None = None, *,
                 on_progress: Callable[[str], None] | None = None) -> Report:
    """Read the runs, draw every figure, write summary.json and summary.md into the report directory."""
    target = report_dir(run_dirs, out)
    say = on_progress or (lambda message: None)
    runs = load_runs(run_dirs)
    say(f"read {', '.join(f'{run.label} ({len(run.records)} steps)' for run in runs)}")
    document = build_summary(runs)

    figures = figures_for(runs)

    def fill(tmp: Path) -> list[str]:
        names = []
        for name, caption, draw in figures:
            say(f"drawing {name} ({caption})")
            save(draw(runs), tmp / name)
            names.append(name)
        atomic_write_json(tmp / "summary.json", {**document, "figures": names}, fsync=False)
        atomic_write_text(tmp / "summary.md", render_markdown(document, [(n, c) for n, c, _ in figures]), fsync=False)
        return names + ["summary.json", "summary.md"]

    files = atomic_dir(target, fill, replace=True)
    say(f"report written to {target}")
    return Report(target, {**document, "figures": files[:len(figures)]}, files)


def build_summary(runs: list[ReportRun]) -> dict:
    """summary.json without its list of figures: one entry per run, in the order given."""
    return {"format": FORMAT, "version": VERSION, "runs": [run_summary(run) for run in runs]}

