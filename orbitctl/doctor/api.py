"""The library behind `orbitctl doctor`: ``diagnose`` is the whole command, the rest its parts.

    from orbitctl.doctor import api
    report = api.diagnose(log="train.log", profile_path="profiles/x.yaml")
    report.root_cause, report.exit_code, report.by_area()

``diagnose`` looks up ``take_snapshot``, ``read_log``, ``run_checks``, ``triage_log`` and ``diagnose_run`` in
this module when it runs, so a test that patches ``orbitctl.doctor.api.<name>`` reaches it.
Nothing here imports torch; the probes and checks are imported when first used.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from orbitctl.doctor.findings import FAIL, WARN, Finding, Report
from orbitctl.doctor.snapshot import Snapshot, load_snapshot, save_snapshot
from orbitctl.units import MiB

__all__ = ["MAX_LOG_BYTES", "check_ids", "diagnose", "diagnose_run", "read_log", "run_checks", "take_snapshot",
           "triage_log"]

MAX_LOG_BYTES = 512 * MiB
"""read_log reads at most this much of a log: its start and its end when the file is larger."""


def take_snapshot(gpu_probe: Any = None, *, probe_torch: bool = True) -> Snapshot:
    """Probe this machine now (NVML, torch, host, env, kernel log, MASTER_PORT)."""
    from orbitctl.doctor.probe_host import take_snapshot as _take

    return _take(gpu_probe, probe_torch=probe_torch)


def _load_checks() -> None:
    # Importing the modules registers their checks, in this order.
    from orbitctl.doctor import checks_gpu, checks_topo, checks_env, checks_cpu, checks_profile, active  # noqa: F401, I001


def run_checks(snapshot: Snapshot, *, expect_gpus: int | None = None, profile: Any = None,
               active: bool = False) -> list[Finding]:
    """Every check that applies, in a stable order, each a Finding with a stable id."""
    from orbitctl.doctor.registry import CheckContext, run_registered

    _load_checks()
    return run_registered(snapshot, CheckContext(expect_gpus=expect_gpus, profile=profile, active=active))


def check_ids(*, profile: bool = True, active: bool = True) -> list[str]:
    """Ids of every registered check (for docs and tests)."""
    from orbitctl.doctor.registry import REGISTRY

    _load_checks()
    return [c.id for c in REGISTRY if (c.when != "profile" or profile) and (c.when != "active" or active)]


def triage_log(text: str, *, profile: Any = None):
    """Classify a log's failures; ``.root_cause`` is the one the others follow from."""
    from orbitctl.doctor.triage import triage_log as _triage

    return _triage(text, profile=profile)


def diagnose_run(run_dir: str, *, profile: Any = None) -> list[Finding]:
    """Why a training run is unstable, from its metrics.jsonl: ranked findings, or one PASS when nothing is alarming."""
    from orbitctl.doctor.run_health import diagnose_run as _diagnose

    return _diagnose(run_dir, profile=profile)


def read_log(path: str) -> str:
    """Read a log file (or stdin for '-') as text; undecodable bytes are replaced, never fatal."""
    from orbitctl.errors import InputFileError

    if path == "-":
        data = sys.stdin.buffer.read(MAX_LOG_BYTES) if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    else:
        file = Path(path)
        if not file.is_file():
            raise InputFileError(f"{path}: log file not found", fix="Pass the run's log file, or - to read stdin")
        try:
            with file.open("rb") as fh:
                size = file.stat().st_size
                if size <= MAX_LOG_BYTES:
                    data = fh.read()
                else:  # the start (setup) and the end (where runs die) of a huge log
                    head = fh.read(MAX_LOG_BYTES // 8)
                    fh.seek(size - (MAX_LOG_BYTES - len(head)))
                    data = head + b"\n" + fh.read()
        except OSError as exc:
            raise InputFileError(f"{path}: cannot read log ({exc.strerror})", fix="Check the path and its permissions") from exc
    return data.decode("utf-8", errors="replace")


def diagnose(*, snapshot_path: str | None = None, save_snapshot_path: str | None = None, log: str | None = None,
             profile_path: str | None = None, overrides: list[str] | None = None, expect_gpus: int | None = None,
             active: bool = False, machine: bool | None = None, gpu_probe: Any = None,
             run_dir: str | None = None) -> Report:
    """The whole `orbitctl doctor` run: machine checks, log triage, a training run's metrics, profile fit.

    ``machine`` None = check the machine unless only a log or a run directory was given (both are
    often read on another computer than the one they came from). ``run_dir`` is judged against its
    own profile.yaml, or against ``profile_path`` (with ``overrides``) when one is given.
    """
    from orbitctl.doctor.registry import NO_GPU, NO_GPU_FIX
    from orbitctl.errors import UserError

    if overrides and not profile_path:
        raise UserError("--set needs a PROFILE", fix="orbitctl doctor PROFILE --set KEY=VALUE")
    if machine is False:
        if not log and not run_dir:
            raise UserError("--no-machine without --log or --run leaves nothing to check",
                            fix="add --log FILE or --run RUN_DIR, or drop --no-machine")
        machine_only = [flag for flag, given in (("--snapshot", snapshot_path), ("--save-snapshot", save_snapshot_path),
                                                 ("--expect-gpus", expect_gpus is not None), ("--active", active)) if given]
        if machine_only:
            raise UserError(f"--no-machine with {', '.join(machine_only)}: they check a machine",
                            fix="drop --no-machine, or drop " + ", ".join(machine_only))
    if machine is None and (log or run_dir) and (expect_gpus is not None or active):
        machine = True  # both check the machine, so a log is not all there is to read
    profile = None
    if profile_path:
        from orbitctl.profile import load_profile

        profile = load_profile(profile_path, overrides or [])
    report = Report(log_source=log)
    log_text = read_log(log) if log else None
    run_found = diagnose_run(run_dir, profile=profile) if run_dir is not None else None  # bad input fails before probing
    if machine is None:
        machine = (log is None and run_dir is None) or snapshot_path is not None or save_snapshot_path is not None
    if machine:
        if snapshot_path:
            snap = load_snapshot(snapshot_path)
            report.snapshot_source = snapshot_path
        else:
            snap = take_snapshot(gpu_probe)
            report.snapshot_source = "live"
            if active:
                from orbitctl.doctor.active import run_active

                run_active(snap)
        if save_snapshot_path:
            save_snapshot(snap, save_snapshot_path)
        report.findings.extend(run_checks(snap, expect_gpus=expect_gpus, profile=profile, active=active))
        skipped = report.no_gpu_skips()
        if skipped:
            report.notes.append(f"{NO_GPU} ({snap.nvml.detail or 'NVML sees no GPU'}): {len(skipped)} GPU checks "
                                f"SKIP (--json lists them). {NO_GPU_FIX}")
        from orbitctl.doctor.isa import isa_rows

        report.isa = [row.to_dict() for row in isa_rows(snap.host.cpu.isa)]
    if log_text is not None:
        triage = triage_log(log_text, profile=profile)
        report.findings = triage.findings + report.findings
        report.root_cause = triage.root_cause
        if triage.root_cause is None:
            report.notes.append(f"log: no known failure signature in {triage.lines} line(s)")
    if run_found is not None:
        report.findings = run_found + report.findings
        alarming = [f.id for f in run_found if f.status in (FAIL, WARN)]
        report.notes.append(f"training run {run_dir}: " + (f"first cause {alarming[0]} of {len(alarming)}" if alarming
                                                            else "nothing alarming in its metrics"))
    return report
