"""Does this machine have what the profile asks for? Asked before any data, model or process group.

A CPU profile (``hardware.gpu: cpu``) runs its ranks as CPU processes over gloo and needs nothing
more. A GPU profile needs ``hardware.gpus_per_node`` GPUs of its model with the memory the plan
assumed: the same probes and profile checks as ``orbitctl doctor PROFILE`` (NVML), judged here
as a refusal (exit 2) that names the shortfall and the fix. :func:`check_inputs` asks the same of
the files train reads: the model it loads and the data files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbitctl.errors import UserError

MACHINE_CHECKS = ("gpu.count", "prof.gpu", "prof.mem")
"""The doctor checks that decide whether the ranks can start at all."""


@dataclass
class MachineFit:
    """What the launcher needs to know about this machine."""

    gpus: int = 0
    numa_nodes: list[int | None] = field(default_factory=list)
    """Each GPU's NUMA node as sysfs reports it (None or -1: the platform gives none)."""

    @property
    def numa_known(self) -> bool:
        return bool(self.numa_nodes) and all(n is not None and n >= 0 for n in self.numa_nodes)


def check_machine(profile, snapshot=None) -> MachineFit:
    """The machine's GPUs when they are what ``profile`` needs; a UserError naming what is missing otherwise.
    ``snapshot`` (a doctor Snapshot) is probed now when not given."""
    hw = profile.hardware
    if hw.gpu == "cpu":
        return MachineFit()
    from orbitctl.doctor import api as doctor

    snap = snapshot if snapshot is not None else doctor.take_snapshot(probe_torch=False)
    findings = doctor.run_checks(snap, expect_gpus=hw.gpus_per_node, profile=profile)
    failed = [f for f in findings if f.id in MACHINE_CHECKS and f.status in ("FAIL", "UNKNOWN")
              and not (f.id == "gpu.count" and len(snap.nvml.gpus) >= hw.gpus_per_node)]
    if failed:
        evidence = "; ".join(dict.fromkeys(f.evidence[0] for f in failed if f.evidence))
        raise UserError(f"hardware: the profile needs {hw.gpus_per_node} x {hw.gpu} on this node, and here {evidence}",
                        fix=f"run it on a node with {hw.gpus_per_node} {hw.gpu} GPUs, or set hardware.gpu and "
                            f"hardware.gpus_per_node to this machine's (`orbitctl doctor PROFILE` shows what is "
                            f"here; `orbitctl plan` then says whether the run still fits)")
    gpus = snap.nvml.gpus[: hw.gpus_per_node]
    return MachineFit(len(gpus), [g.numa_node for g in gpus])


DATA_FILE_HELP = ("a data file, e.g. JSONL with one record per line in GSM8K's question/answer, MATH's problem/solution, "
                  "prompt/answer or chat messages fields (docs/train.md, \"Data files\")")
"""What a data file holds, for the refusal of a missing one."""


def check_inputs(profile) -> None:
    """The files train would read exist here, else a UserError (exit 2) naming each missing one's key, on one line.

    The model train loads is ``model.quantized_path`` when it is set (used as is; ``model.path`` is then read only by
    ``orbitctl quantize``, which writes it), else ``model.path``; ``data.train`` and ``data.eval`` when they name
    files rather than builtin tasks or environments. Relative paths are taken from the working directory, as train
    takes them."""
    from pathlib import Path

    problems, fixes = _model_problems(profile.model), []
    if problems:
        fixes.append(problems.pop())
    for key in ("train", "eval"):
        value = getattr(profile.data, key)
        if value and not value.startswith(("builtin:", "env:")) and not Path(value).expanduser().exists():
            problems.append(f"data.{key}: {value} does not exist{_relative(value)}")
            fixes.append(f"bring {DATA_FILE_HELP} and point data.{key} at it")
    if problems:
        fix = "; ".join(dict.fromkeys(fixes))
        raise UserError("; ".join(problems), fix=fix[:1].upper() + fix[1:])


def _model_problems(model) -> list[str]:
    """What is missing of the model train loads: the problems, then one fix last; [] when it is there."""
    from pathlib import Path

    if model.quantized_path:
        if (Path(model.quantized_path).expanduser() / "config.json").is_file():
            return []  # used as is: model.path is not read
        problem = f"model.quantized_path: {model.quantized_path} holds no quantized base (no config.json)"
        source = _source_problem(model.path) if model.path else "model.path: not set"
        if source is None:
            return [problem, "write it with `orbitctl quantize PROFILE` (it reads model.path), or point "
                             "model.quantized_path at a base quantized with this profile's quant settings"]
        return [problem, source, "download the Hugging Face checkpoint to model.path and write model.quantized_path "
                                 "from it with `orbitctl quantize PROFILE`, or point model.quantized_path at a base "
                                 "quantized with this profile's quant settings"]
    source = _source_problem(model.path) if model.path else None
    if source is None:
        return []
    return [source, "point model.path at a Hugging Face checkpoint directory (config.json and safetensors) or a GGUF "
                    "file"]


def _source_problem(value: str) -> str | None:
    """Why ``model.path`` cannot be read, or None when it holds a checkpoint (a ``pkg:`` path that does not resolve
    raises its own UserError naming the key)."""
    from orbitctl.arch.model_source import is_gguf, resolve_model_path

    source = resolve_model_path(value)
    if (source / "config.json").is_file() or (source.is_file() and is_gguf(source)):
        return None
    if not source.exists():
        return f"model.path: {value} does not exist{_relative(value)}"
    return f"model.path: {value} has neither a config.json nor a GGUF file"


def _relative(value: str) -> str:
    """' (from DIR)' for a relative path: where it was looked for."""
    import os
    from pathlib import Path

    return "" if Path(value).expanduser().is_absolute() else f" (from {os.getcwd()})"
