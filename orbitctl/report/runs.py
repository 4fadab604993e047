"""The training runs a report is made from: metrics, profile, summary and the plan's memory per phase.

    runs = load_runs(["runs/single-node", "runs/two-nodes"])
    runs[0].label, runs[0].series("reward_mean"), runs[0].predicted["rollout"], runs[0].entropy.verdict

Each run is named by its directory name in every legend and table; two runs whose directories share a
name are told apart by as many parent directories as it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orbitctl.errors import InputFileError, OrbitError, UserError
from orbitctl.report.entropy import EntropyJudgement, judge_entropy
from orbitctl.rundir import RUN_DIR_FIX, RunDir, metric_series, read_json, read_metrics


@dataclass
class ReportRun:
    """One run directory, read once."""

    label: str
    """What legends and tables call the run: its directory name."""
    root: Path
    records: list[dict]
    """metrics.jsonl, one record per optimizer step, in step order."""
    profile: object
    """The validated profile the run was started with (its profile.yaml)."""
    summary: dict
    """The run's summary.json ({} while a run has not written one)."""
    predicted: dict[str, int | None]
    """The plan's peak bytes per phase: as the run recorded it, else ``orbitctl plan`` for its profile ({} when it
    could not be planned)."""
    entropy: EntropyJudgement
    notes: list[str] = field(default_factory=list)
    """What the report could not use, said once (e.g. why there is no plan)."""

    def series(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` of every record with a finite ``name``."""
        return metric_series(self.records, name)

    def eval_series(self) -> list[tuple[int, float]]:
        """Held-out accuracy at the steps it was measured, with summary.json's ``eval_before`` at step 0."""
        points = self.series("eval_accuracy")
        before = self.summary.get("eval_before")
        if isinstance(before, (int, float)) and not isinstance(before, bool) and not any(s == 0 for s, _ in points):
            points = [(0, float(before))] + points
        return points

    def phase_memory(self) -> dict[str, list[tuple[int, int]]]:
        """``(step, bytes)`` per measured phase: the largest rank's peak of that phase at each step."""
        phases: dict[str, list[tuple[int, int]]] = {}
        for record in self.records:
            for phase, entry in (record.get("phase_memory") or {}).items():
                measured = [m for m in (entry or {}).get("measured_bytes") or [] if isinstance(m, (int, float))]
                if measured:
                    phases.setdefault(phase, []).append((record["step"], int(max(measured))))
        return phases

    @property
    def memory_kind(self) -> str | None:
        """What the measured bytes are (``rss_rise`` on the CPU, ``cuda_max_allocated`` on a GPU)."""
        kinds = [r["phase_memory_kind"] for r in self.records if r.get("phase_memory_kind")]
        return kinds[-1] if kinds else None


def load_runs(paths: list[str | Path]) -> list[ReportRun]:
    """Read every run directory; a missing directory, metrics file or profile is exit 2 naming the path."""
    if not paths:
        raise UserError("no run directory given", fix="pass one or more, e.g. orbitctl report runs/tiny-cpu")
    roots = [Path(p) for p in paths]
    resolved = [r.resolve() for r in roots]
    for i, root in enumerate(resolved):
        if root in resolved[:i]:
            raise UserError(f"{roots[i]}: given twice", fix="pass each run directory once")
    labels = _labels(resolved)
    return [_load_run(root, label) for root, label in zip(roots, labels)]


def _load_run(root: Path, label: str) -> ReportRun:
    from orbitctl.profile import load_profile

    records = read_metrics(root)
    run = RunDir(root)
    if not run.profile.is_file():
        raise InputFileError(f"{run.profile}: no {run.PROFILE} in the run directory",
                             fix=f"{RUN_DIR_FIX}; orbitctl train writes it when the run starts")
    profile = load_profile(run.profile)
    summary = read_json(run.summary, what="run summary") if run.summary.exists() else {}
    notes: list[str] = []
    predicted = _recorded_plan(records) or _plan_phases(profile, notes)
    alignment = profile.alignment
    entropy = judge_entropy(metric_series(records, "entropy"), alignment.entropy_window,
                            alignment.entropy_fluctuation_max)
    return ReportRun(label, root, records, profile, summary, predicted, entropy, notes)


def _recorded_plan(records: list[dict]) -> dict[str, int | None]:
    """The plan's peak per phase as the run itself recorded it (``phase_memory.predicted_bytes``: the plan train made
    for this device, its ``auto`` dtypes resolved); empty when no step recorded one."""
    for record in reversed(records):
        phases = record.get("phase_memory") or {}
        if phases:
            return {phase: entry.get("predicted_bytes") for phase, entry in phases.items()}
    return {}


def _plan_phases(profile, notes: list[str]) -> dict[str, int | None]:
    """The plan's peak per phase; a profile the planner refuses (a model config file since moved) leaves none."""
    from orbitctl.plan import plan_profile

    try:
        return dict(plan_profile(profile, with_advice=False).phase_peak_bytes)
    except (OrbitError, OSError) as exc:
        notes.append(f"no plan for the profile ({exc}); memory is shown without a prediction")
        return {}


def _labels(roots: list[Path]) -> list[str]:
    """Directory names, lengthened by parent directories until no two are equal."""
    depth = 1
    while True:
        labels = ["/".join(root.parts[-depth:]) for root in roots]
        if len(set(labels)) == len(labels) or depth >= max(len(r.parts) for r in roots):
            return labels
        depth += 1
