"""`orbitctl doctor`: what is wrong with this machine, why did the run die, why is training unstable.

    orbitctl doctor
    orbitctl doctor profiles/kimi-k2_grpo_int4_8xb200.yaml --log train.log
    orbitctl doctor --run runs/tiny-cpu
    orbitctl doctor --save-snapshot node7.json
    orbitctl doctor --snapshot node7.json --json
"""

from __future__ import annotations

from typing import List, Optional

import typer

from orbitctl.cli import output
from orbitctl.cli.command import Command
from orbitctl.cli.common import JsonOption, SetOption, overrides


def doctor(
    profile: Optional[str] = typer.Argument(None, metavar="PROFILE",
                                            help="Check the profile's hardware against this machine and plan for its "
                                                 "free memory."),
    log: Optional[str] = typer.Option(None, "--log", "-l", metavar="FILE", help="A failed run's log to triage ('-' reads stdin)."),
    run: Optional[str] = typer.Option(None, "--run", metavar="RUN_DIR",
                                      help="A training run's directory: why training is unstable, from its metrics.jsonl "
                                           "(judged against its profile.yaml, or PROFILE)."),
    set_: Optional[List[str]] = SetOption,
    snapshot: Optional[str] = typer.Option(None, "--snapshot", metavar="FILE", help="Run the checks on a saved snapshot."),
    save_snapshot: Optional[str] = typer.Option(None, "--save-snapshot", metavar="FILE", help="Write the probed snapshot as JSON."),
    expect_gpus: Optional[int] = typer.Option(None, "--expect-gpus", min=1, help="GPUs this node must have."),
    active: bool = typer.Option(False, "--active", help="Also run a live all-reduce and `dcgmi diag -r 1` (takes minutes)."),
    machine: Optional[bool] = typer.Option(None, "--machine/--no-machine",
                                           help="Check the machine too (default: yes, unless --log or --run is given without "
                                                "--snapshot, --save-snapshot, --expect-gpus or --active)."),
    json_out: bool = JsonOption,
) -> None:
    """Diagnose the machine (driver, GPUs, ECC, PCIe, NVLink, NUMA, NCCL env), a failed run's log and an unstable run.

    Exit code 1 when any finding is FAIL, 2 for a missing or malformed input file.

    Examples:

        orbitctl doctor

        orbitctl doctor profiles/tiny-cpu.yaml --log train.log

        journalctl -u train --no-pager | orbitctl doctor --log - --json

        orbitctl doctor --run runs/tiny-cpu --json
    """
    from orbitctl.doctor import api

    report = api.diagnose(snapshot_path=snapshot, save_snapshot_path=save_snapshot, log=log, profile_path=profile,
                          overrides=overrides(set_), expect_gpus=expect_gpus, active=active, machine=machine,
                          run_dir=run)
    if json_out:
        output.emit_json(report.to_dict())
    else:
        render(report)
        if save_snapshot:
            output.info(f"snapshot written to {save_snapshot}")
    if report.failed:
        from orbitctl.errors import CheckFailed

        failed = report.failed_ids()
        raise CheckFailed(f"doctor found {len(failed)} failure(s): {', '.join(failed)}")


def render(report) -> None:
    from rich.table import Table
    from rich.text import Text

    for note in report.notes:
        output.show(Text(note, style="bold"))
    if report.root_cause is not None:
        rc = report.root_cause
        where = f" on rank {rc.rank}" if rc.rank is not None else ""
        output.show(output.status(rc.status, f"Root cause: {rc.id}{where}: {rc.title}"))
    for area, rows in report.by_area(without_no_gpu_skips=True):
        table = Table(title=area, title_justify="left", show_lines=True, expand=False)
        table.add_column("status", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("evidence", overflow="fold")
        table.add_column("fix", overflow="fold")
        for f in rows:
            evidence = Text(f.title + "\n", style="bold")
            evidence.append("\n".join(f.shown_evidence))
            table.add_row(output.status(f.status), f.id, evidence, Text(f.fix or ""))
        output.show(table)
    summary = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    output.show(output.status(report.verdict, f"{report.verdict}: {summary}"))


def register(app: typer.Typer) -> None:
    app.command("doctor", cls=Command)(doctor)
