"""`plan --measure-time`: time real RL steps of the profile on this machine, next to the time model.

Measures this machine's matmul throughput (a GEMM of the model's own update shape, and the adapters' thin one, in the
compute dtype), its memory bandwidth (a large tensor copy), the cost of one eager op as a model's modules issue it
and of one CPU attention work item (microbenchmarks of a fixed tiny size), runs ``orbitctl train`` for ``STEPS`` steps in a temporary run
directory on one thread, and reads the steps' ``time_rollout_s`` and ``time_update_s`` from metrics.jsonl (the
fastest of the steps after the first, as each microbenchmark is the best of its runs). The prediction is
timing.py's at the measured rates with every efficiency factor 1 (the rates are already what this machine
achieves); nothing is fitted. Imports no torch itself: the child does.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field

from orbitctl.plan.timing import Efficiency, Peaks, StepTime, peaks_of_rates  # noqa: F401 (benchmarks import it here)

STEPS = 6
"""Steps timed: the first pays the warm-up (allocator, lazy kernels, new GEMM shapes); the prediction is of a
steady step, measured as the fastest of the other five (on shared cores the slower ones are the neighbours' time:
with three, one run in three of the demo's 25 ms rollout still measured a burst, 35 ms)."""
THREADS = 1
"""Torch threads of the timed child: on a machine whose cores are shared a second thread waits on a busy core and
the step's time is the scheduler's; one thread times this core, and the microbenchmarks run on the same one."""


@dataclass
class TimeMeasurement:
    """Measured rates, the predicted step at those rates and the measured seconds per phase."""

    flops_per_s: float
    bytes_per_s: float
    predicted: StepTime
    measured_s: dict[str, float]
    notes: list[str] = field(default_factory=list)
    rates: dict = field(default_factory=dict)
    """Everything the child measured (op_s, attention_block_s, adapter_flops_per_s, threads, first-step times)."""
    calibrated: StepTime | None = None
    """The plan's prediction at hardware.calibration's rates, when the profile names a calibration file."""

    @property
    def rows(self) -> list[dict]:
        out = []
        for phase, measured in self.measured_s.items():
            predicted = self.predicted.phases[phase].seconds
            row = {"phase": phase, "predicted_s": predicted, "measured_s": measured,
                   "bound": self.predicted.phases[phase].bound,
                   "predicted_over_measured": predicted / measured if measured else None}
            if self.calibrated is not None:
                calibrated = self.calibrated.phases[phase].seconds
                row.update(calibrated_s=calibrated, calibrated_over_measured=calibrated / measured if measured else None)
            out.append(row)
        return out

    def to_dict(self) -> dict:
        return {"flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s, "rates": dict(self.rates),
                "rows": self.rows, "predicted": self.predicted.to_dict(), "notes": list(self.notes)}


def predict_at(profile, peaks: Peaks) -> StepTime:
    """timing.step_time of the profile at ``peaks``, efficiency 1."""
    from orbitctl.plan import _arch
    from orbitctl.plan.budget import prepare
    from orbitctl.plan.comm import communication
    from orbitctl.plan.layout import layout_of
    from orbitctl.plan.timing import step_time

    inp = prepare(profile, _arch(profile))
    layout = layout_of(profile, inp.arch.num_experts)
    comm = communication(profile, inp.arch, inp.storage, layout, inp.adapters)
    adapter_bytes = inp.adapters.trainable_params * (2 if profile.adapter.dtype == "bf16" else 4)
    return step_time(profile, inp.arch, inp.storage, layout, comm, adapter_bytes=adapter_bytes,
                     eff=Efficiency(compute=1.0, hbm=1.0, link=1.0), peaks=peaks, adapters=inp.adapters)


def measure_time(profile) -> TimeMeasurement:
    """Real steps of ``profile`` (one rank, CPU, one thread) against the prediction at this machine's measured rates.

    The step runs in a child process (``python -m orbitctl.rl.steptime``): the planner sits below the
    trainer and the model, and talks to them only through that command and its JSON."""
    import os
    import subprocess
    import sys

    from orbitctl.errors import RunFailed, UserError
    from orbitctl.profile.loader import dump_profile

    if profile.world_size != 1:
        raise UserError(f"--measure-time runs one rank; the profile has {profile.world_size}",
                        fix="add --set hardware.gpus_per_node=1 (and --set memory.expert_parallel=1 on a MoE profile)")
    if profile.hardware.gpu != "cpu":
        raise UserError("--measure-time measures CPU profiles so far", fix="plan a profile with hardware.gpu: cpu")
    from orbitctl.plan import _arch

    arch = _arch(profile)
    tokens = min(profile.memory.micro_batch_size, profile.rl.prompts_per_step * profile.rl.group_size)
    gemm = (tokens * profile.memory.seq_len, arch.hidden_size, max(arch.hidden_size, arch.intermediate_size))
    from orbitctl.plan.adapters import plan_adapters

    rank = plan_adapters(arch, profile.adapter).rank
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    with tempfile.TemporaryDirectory(prefix="orbitctl-measure-time-") as tmp:
        path = f"{tmp}/profile.yaml"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(dump_profile(profile))
        done = subprocess.run([sys.executable, "-m", "orbitctl.rl.steptime", path, f"{tmp}/run", *map(str, gemm),
                               str(rank), str(STEPS)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RunFailed(f"--measure-time: the training step failed: {last}", fix="run orbitctl train on the profile to see why")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    flops, bandwidth = got["flops_per_s"], got["bytes_per_s"]
    predicted = predict_at(profile, peaks_of_rates(got))
    measured = {"rollout": got["rollout_s"], "policy_update": got["policy_update_s"]}
    rates = {k: v for k, v in got.items() if k not in ("rollout_s", "policy_update_s")}
    notes = [f"one rank, {got['threads']} thread(s); measured now: {got['dtype']} matmul {gemm[0]}x{gemm[1]}x{gemm[2]} "
             f"(the update's widest) at {flops / 1e9:.1f} GFLOP/s, the adapters' x{rank} at "
             f"{got['adapter_flops_per_s'] / 1e9:.1f} GFLOP/s, memory copy at {bandwidth / 1e9:.1f} GB/s, "
             f"{got['op_s'] * 1e6:.1f} us per eager op (transformers' modules), "
             f"{got['attention_block_s'] * 1e6:.1f} us per attention item"
             + ("; the fused INT4 kernel at " + ", ".join(f"{rows} rows {rate / 1e9:.1f}"
                                                          for rows, rate in got["kernel_flops_per_s"]) + " GFLOP/s"
                if got.get("kernel_flops_per_s") else ""),
             f"measured: the fastest of steps 2-{got['steps']} (the first, with its warm-up: rollout "
             f"{got['first_rollout_s']:.3f} s, update {got['first_policy_update_s']:.3f} s); "
             "efficiency 1, nothing fitted"]
    calibrated = None
    if profile.hardware.calibration:
        from orbitctl.plan.timing import profile_rates

        calibrated = predict_at(profile, profile_rates(profile)[1])
        notes.append(f"calibrated: the plan at {profile.hardware.calibration}'s rates, measured before this run")
    return TimeMeasurement(flops, bandwidth, predicted, measured, notes, rates=rates, calibrated=calibrated)
