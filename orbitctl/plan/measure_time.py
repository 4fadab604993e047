"""`plan --measure-time`: time one real RL step of the profile on this machine, next to the time model.

Measures this machine's matmul throughput (a GEMM of the model's own update shape, in the compute dtype) and its memory
bandwidth (a large tensor copy), runs ``orbitctl train`` for one step in a temporary run
directory, and reads the step's ``time_rollout_s`` and ``time_update_s`` from metrics.jsonl.
The prediction is timing.py's at the measured rates with every efficiency factor 1 (the
rates are already what this machine achieves); nothing is fitted. Imports torch (lazily,
like ``--measure``); the rest of the planner stays torch-free.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field

from orbitctl.plan.timing import Efficiency, Peaks, StepTime

@dataclass
class TimeMeasurement:
    """Measured rates, the predicted step at those rates and the measured seconds per phase."""

    flops_per_s: float
    bytes_per_s: float
    predicted: StepTime
    measured_s: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def rows(self) -> list[dict]:
        out = []
        for phase, measured in self.measured_s.items():
            predicted = self.predicted.phases[phase].seconds
            out.append({"phase": phase, "predicted_s": predicted, "measured_s": measured,
                        "bound": self.predicted.phases[phase].bound,
                        "predicted_over_measured": predicted / measured if measured else None})
        return out

    def to_dict(self) -> dict:
        return {"flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s, "rows": self.rows,
                "predicted": self.predicted.to_dict(), "notes": list(self.notes)}


def _predict(profile, peaks: Peaks) -> StepTime:
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
                     eff=Efficiency(compute=1.0, hbm=1.0, link=1.0), peaks=peaks)


def measure_time(profile) -> TimeMeasurement:
    """One real step of ``profile`` (one rank, CPU) against the prediction at this machine's measured rates.

    The step runs in a child process (``python -m orbitctl.rl.steptime``): the planner sits below the
    trainer and the model, and talks to them only through that command and its JSON."""
    import subprocess
    import sys

    import yaml

    from orbitctl.errors import RunFailed, UserError

    if profile.world_size != 1:
        raise UserError(f"--measure-time runs one rank; the profile has {profile.world_size}",
                        fix="add --set hardware.gpus_per_node=1 (and --set memory.expert_parallel=1 on a MoE profile)")
    if profile.hardware.gpu != "cpu":
        raise UserError("--measure-time measures CPU profiles so far", fix="plan a profile with hardware.gpu: cpu")
    from orbitctl.plan import _arch

    arch = _arch(profile)
    tokens = min(profile.memory.micro_batch_size, profile.rl.prompts_per_step * profile.rl.group_size)
    gemm = (tokens * profile.memory.seq_len, arch.hidden_size, max(arch.hidden_size, arch.intermediate_size))
    with tempfile.TemporaryDirectory(prefix="orbitctl-measure-time-") as tmp:
        path = f"{tmp}/profile.yaml"
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(profile.model_dump(mode="json"), fh, sort_keys=False)
        done = subprocess.run([sys.executable, "-m", "orbitctl.rl.steptime", path, f"{tmp}/run", *map(str, gemm)],
                              capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RunFailed(f"--measure-time: the training step failed: {last}", fix="run orbitctl train on the profile to see why")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    flops, bandwidth = got["flops_per_s"], got["bytes_per_s"]
    peaks = Peaks(flops=flops, hbm=bandwidth, link=bandwidth, nic=bandwidth)
    predicted = _predict(profile, peaks)
    measured = {"rollout": got["rollout_s"], "policy_update": got["policy_update_s"]}
    notes = [f"one rank; measured now: {got['dtype']} matmul {gemm[0]}x{gemm[1]}x{gemm[2]} (the update's widest) at "
             f"{flops / 1e9:.1f} GFLOP/s, memory copy at {bandwidth / 1e9:.1f} GB/s; efficiency 1, nothing fitted",
             "the model counts FLOPs and bytes only: per-op overhead (Python, kernel calls, dequantization calls) "
             "of a tiny model is not in it"]
    return TimeMeasurement(flops, bandwidth, predicted, measured, notes)
