"""What `orbitctl plan` computes, callable from Python: plan, sweep, measurement or the catalog."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orbitctl.errors import UserError
from orbitctl.units import GiB


@dataclass
class PlanRun:
    """What one ``orbitctl plan`` computed: a plan (with its measurements or comparison), a sweep, or the
    built-in architectures."""

    profile_name: str | None = None
    plan: Any = None
    sweep: list[dict] | None = None
    measurement: Any = None
    time_measurement: Any = None
    """orbitctl.plan.measure_time.TimeMeasurement (``--measure-time``)."""
    comparison: dict | None = None
    """orbitctl.plan.compare.compare's rows (``--compare``)."""
    archs: list[dict] | None = None
    usable_bytes: int = 0
    calibration: str | None = None
    """The calibration file ``--calibrate`` wrote (the plan uses it)."""

    @property
    def ok(self) -> bool:
        """The exit status: the plan fits (a sweep: some combination fits)."""
        if self.archs is not None:
            return True
        if self.sweep is not None:
            return any(row["fits"] for row in self.sweep)
        return bool(self.plan.fits)

    def failure(self) -> str:
        """One line saying why the exit status is 1."""
        if self.sweep is not None:
            return f"no swept combination fits in {self.usable_bytes / GiB:.1f} GiB per GPU"
        return f"{self.profile_name}: {self.plan.verdict()}"

    def to_dict(self) -> dict:
        if self.archs is not None:
            return {"archs": self.archs}
        doc: dict[str, Any] = {"profile": self.profile_name}
        if self.sweep is not None:
            doc.update(usable_bytes=self.usable_bytes, sweep=self.sweep)
            return doc
        doc.update(self.plan.to_dict())
        if self.measurement is not None:
            doc["measurement"] = self.measurement.to_dict()
        if self.time_measurement is not None:
            doc["time_measurement"] = self.time_measurement.to_dict()
        if self.comparison is not None:
            doc["comparison"] = self.comparison
        if self.calibration is not None:
            doc["calibration_written"] = self.calibration
        return doc


def parse_sweep(item: str) -> tuple[str, list[Any]]:
    """'memory.micro_batch_size=1,2,4' -> ('memory.micro_batch_size', [1, 2, 4])."""
    import yaml

    key, sep, raw = item.partition("=")
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not sep or not key.strip() or not values:
        raise UserError(f"--sweep {item}: expected KEY=V1,V2,...", fix="e.g. --sweep memory.micro_batch_size=1,2,4,8")
    return key.strip(), [yaml.safe_load(v) for v in values]


def run_plan(path: str | None, overrides: list[str] | tuple[str, ...] = (), *, sweeps: list[str] | None = None,
             measure: bool = False, list_archs: bool = False, gpu_memory_bytes: int | None = None,
             measure_time: bool = False, compare: str | None = None, calibrate: bool = False,
             out: str | None = None) -> PlanRun:
    """Load the profile at ``path`` (with --set overrides) and plan, sweep or measure it."""
    from orbitctl.plan import apply_changes, plan_profile, plan_sweep

    if list_archs:
        from orbitctl.arch import builtin_arch, builtin_names

        extra = [name for name, given in (("PROFILE", path), ("--set", list(overrides)), ("--sweep", sweeps),
                                          ("--measure", measure), ("--calibrate", calibrate),
                                          ("--measure-time", measure_time), ("--compare", compare)) if given]
        if extra:
            raise UserError(f"--list-archs lists the built-in architectures and takes no {', '.join(extra)}",
                            fix="run orbitctl plan --list-archs on its own (--json is fine)")

        return PlanRun(archs=[builtin_arch(n).summary() for n in builtin_names()])
    if not path:
        raise UserError("missing PROFILE", fix="give a profile YAML file, e.g. orbitctl plan profiles/tiny-cpu.yaml")
    if out is not None and not calibrate:
        raise UserError("--out names the file --calibrate writes", fix="add --calibrate, or drop --out")
    if sweeps and calibrate:
        raise UserError("--calibrate measures one profile's kernels, not a sweep", fix="drop --sweep")
    if sweeps and (measure or measure_time):
        raise UserError("--measure and --measure-time calibrate one plan, not a sweep",
                        fix="drop them, or plan one setting with --set KEY=VALUE --measure")
    if compare is not None:
        extra = [name for name, given in (("--sweep", sweeps), ("--measure", measure), ("--measure-time", measure_time))
                 if given]
        if extra:
            raise UserError(f"--compare ranks the profile's own run in other layouts; it takes no {', '.join(extra)}",
                            fix="run --compare on its own (with --set and --json if wanted)")
        from orbitctl.plan.compare import parse_axes

        axes = parse_axes(compare)
    from orbitctl.profile import load_profile

    profile = load_profile(path, list(overrides))
    run = PlanRun(profile_name=profile.name)
    if calibrate:
        from orbitctl.plan import resolve_rollout_batch
        from orbitctl.plan.kernel_calibration import calibrate as measure_kernels

        target = out or f"calibration-{profile.hardware.gpu}.json"
        run.calibration = str(measure_kernels(resolve_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes),
                                              target))
        profile = load_profile(path, [*overrides, f"hardware.calibration={target}"])
    if sweeps:
        parsed = [parse_sweep(s) for s in sweeps]
        for key, values in parsed:
            for value in values:
                apply_changes(profile, {key: value})  # a bad key or value fails before any planning
        run.sweep = plan_sweep(profile, parsed, gpu_memory_bytes=gpu_memory_bytes)
        run.usable_bytes = plan_profile(profile, gpu_memory_bytes=gpu_memory_bytes, with_advice=False).usable_bytes
        return run
    run.plan = plan_profile(profile, gpu_memory_bytes=gpu_memory_bytes)
    if compare is not None:
        from orbitctl.plan import compare_profile

        run.comparison = compare_profile(profile, axes, gpu_memory_bytes=gpu_memory_bytes)
    if measure or measure_time:
        from orbitctl.plan import resolve_rollout_batch

        profile = resolve_rollout_batch(profile, gpu_memory_bytes=gpu_memory_bytes)
    if measure:
        from orbitctl.plan.measure import calibrate, measure_profile

        run.measurement = measure_profile(profile)
        calibrate(run.plan, run.measurement)
    if measure_time:
        from orbitctl.plan.measure_time import measure_time as time_one_step

        run.time_measurement = time_one_step(profile)
    return run
