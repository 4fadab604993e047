"""`orbitctl report`: figures and a summary of training runs, one run or several overlaid.

    orbitctl report runs/tiny-cpu
    orbitctl report runs/one-node runs/two-nodes --out reports/nodes
    orbitctl report runs/tiny-cpu --json
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption
from orbitctl.units import gib


def report_command(
    run_dirs: List[str] = typer.Argument(..., metavar="RUN_DIR", help="Training run directories (runs/<name>)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="DIR",
                                      help="Report directory (default with one run: RUN_DIR/report; "
                                           "required with several)."),
    json_out: bool = JsonOption,
) -> None:
    """Draw reward, accuracy, entropy stability, mismatch, optimization, throughput and memory per phase.

    Several runs are overlaid, one colour each. The PNGs, summary.json and summary.md appear together or not at all.

    Examples:

        orbitctl report runs/tiny-cpu

        orbitctl report runs/one-node runs/two-nodes --out reports/nodes

        orbitctl report runs/tiny-cpu --json
    """
    from orbitctl.report import write_report

    report = write_report(run_dirs, out, on_progress=None if json_out else output.info)
    if json_out:
        output.emit_json(report.to_dict())
    else:
        render(report)


def render(report) -> None:
    for run in report.document["runs"]:
        entropy = run["entropy"]
        table = output.table(f"{run['name']} ({run['steps']['logged']} steps, {run['status'] or 'no summary'})",
                             ("", "first", "last", "best / max"))
        for name, key, spec in (("reward", "reward", "{:.3f}"), ("rollout accuracy", "accuracy", "{:.1%}")):
            entry = run[key]
            table.add_row(name, _num(entry["first"], spec), _num(entry["last"], spec), _num(entry["best"], spec))
        table.add_row("held-out accuracy", _num(run["eval"]["before"], "{:.1%}"), _num(run["eval"]["after"], "{:.1%}"), "")
        for name, trend in run["mismatch"].items():
            table.add_row(name, _num(trend["first"], "{:.3g}"), _num(trend["last"], "{:.3g}"), _num(trend["max"], "{:.3g}"))
        output.show(table)
        if entropy["verdict"] != "not logged":
            word = "PASS" if entropy["verdict"] == "stable" else "FAIL"
            left = f", left the band at step {entropy['left_band_at_step']}" if entropy["left_band_at_step"] else ""
            output.show(output.status(word, f"entropy {entropy['verdict']}: worst {entropy['worst_fluctuation']:.2%} over "
                                            f"steps {entropy['worst_window'][0]}-{entropy['worst_window'][1]} "
                                            f"(gate < {entropy['fluctuation_max']:.0%}){left}"))
        for phase, entry in run["memory"]["phases"].items():
            ratio = "" if entry["ratio"] is None else f" ({entry['ratio']:.2f}x the plan)"
            output.show(f"{phase} memory peak {gib(entry['measured_peak_bytes'], 3)} GiB{ratio}")
        for warning in run["warnings"]:
            output.warn(f"{run['name']}: step {warning['first_step']} ({warning['steps']} steps): {warning['message']}")
        for note in run["notes"]:
            output.info(f"note: {note}")
    output.show(f"report in {report.out}: {', '.join(report.files)}")


def _num(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def register(app: typer.Typer) -> None:
    app.command("report", cls=Command)(report_command)
