"""The numbers of a report: one dictionary per run, written to summary.json and shown as tables.

Reward and accuracy are the values of the first and the last logged step and the best step. The
mismatch metrics' first and last are means over the first and last 10% of their steps (at least one),
as ``verify-alignment --run`` computes its trend, so the two commands quote the same numbers. Memory
is each phase's peak over the run (the largest rank) beside ``orbitctl plan``'s prediction for the
run's own profile. Step time is the sum of the rollout, reward and update times of a step.
"""

from __future__ import annotations

import math
import statistics

from orbitctl.report.runs import ReportRun

MISMATCH_METRICS = ("mismatch_k3_kl", "mismatch_logp_abs_mean")
PHASE_TIMES = ("time_rollout_s", "time_reward_s", "time_update_s")


def run_summary(run: ReportRun) -> dict:
    """Everything summary.json says about one run (non-finite numbers become null)."""
    steps = [r["step"] for r in run.records]
    doc = {
        "name": run.label,
        "dir": str(run.root),
        "status": run.summary.get("status"),
        "steps": {"logged": len(steps), "first": steps[0], "last": steps[-1]},
        "reward": _progress(run.series("reward_mean")),
        "accuracy": _progress(run.series("accuracy")),
        "eval": {"before": run.summary.get("eval_before"), "after": run.summary.get("eval_after"),
                 "points": [[s, v] for s, v in run.eval_series()]},
        "entropy": run.entropy.to_dict(),
        "mismatch": {name: _edges(run.series(name)) for name in MISMATCH_METRICS},
        "memory": memory_summary(run),
        "step_time_s": {"median": _median(step_times(run))},
        "throughput": {"samples_per_s_median": _median([v for _, v in run.series("samples_per_s")]),
                       "tokens_per_s_median": _median([v for _, v in run.series("tokens_per_s")])},
        "warnings": warnings_seen(run.records),
        "notes": list(run.notes),
    }
    return _finite(doc)


def memory_summary(run: ReportRun) -> dict:
    """Per measured phase: the peak over the run, the plan's prediction and measured/predicted."""
    phases = {}
    for phase, series in run.phase_memory().items():
        peak_step, peak = max(series, key=lambda point: point[1])
        predicted = run.predicted.get(phase)
        phases[phase] = {"measured_peak_bytes": peak, "peak_step": peak_step, "predicted_bytes": predicted,
                         "ratio": peak / predicted if predicted else None}
    return {"kind": run.memory_kind, "phases": phases}


def step_times(run: ReportRun) -> list[float]:
    """Seconds of every step that logged all three phase times."""
    times = []
    for record in run.records:
        parts = [record.get(name) for name in PHASE_TIMES]
        if all(isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) for p in parts):
            times.append(math.fsum(parts))
    return times


def warnings_seen(records: list[dict]) -> list[dict]:
    """Each distinct warning the run logged, with the first step it came at and how many steps gave it."""
    seen: dict[str, dict] = {}
    for record in records:
        for message in record.get("warnings") or []:
            entry = seen.setdefault(str(message), {"message": str(message), "first_step": record["step"], "steps": 0})
            entry["steps"] += 1
    return list(seen.values())


def _progress(series: list[tuple[int, float]]) -> dict:
    if not series:
        return {"first": None, "last": None, "best": None, "best_step": None}
    best_step, best = max(series, key=lambda point: point[1])  # the earliest step on a tie
    return {"first": series[0][1], "last": series[-1][1], "best": best, "best_step": best_step}


def _edges(series: list[tuple[int, float]]) -> dict:
    if not series:
        return {"first": None, "last": None, "max": None, "steps": 0}
    values = [v for _, v in series]
    edge = max(1, len(values) // 10)
    return {"first": math.fsum(values[:edge]) / edge, "last": math.fsum(values[-edge:]) / edge, "max": max(values),
            "steps": len(values)}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _finite(value):
    """JSON has no inf or NaN: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
