"""`orbitctl plan PROFILE --calibrate`: measure the kernels the time model counts, at the profile's shapes, on this
machine, and write the calibration file a profile names as ``hardware.calibration``.

The measuring runs in a child process (``python -m orbitctl.rl.kernelrates``, which imports torch and the kernels):
the planner sits below them. A GPU profile is calibrated on a machine with a GPU of its kind (the device's name must
contain the catalog entry's, e.g. "H200"); a CPU profile on any CPU, on one thread as ``--measure-time`` times it,
the host's tokenizer rates with the profile's own tokenizer (its base is built first where it is not cached).
On one GPU the grouped INT4 experts, a dense bf16 GEMM, decode attention and a device copy take under 2 minutes;
the all-to-all needs the profile's world size and is left to the published rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orbitctl.errors import RunFailed, UserError

THREADS = 1
"""Torch threads of a CPU calibration: the same one thread ``--measure-time`` times the steps on."""
TIMEOUT_S = 300


def kernel_shapes(profile) -> dict:
    """The shapes orbitctl.rl.kernelrates measures for ``profile``: the update's widest GEMM, the routed experts one
    GPU holds at the decode's and the update's rows, decode attention at the cache's full length."""
    from orbitctl.plan import _arch
    from orbitctl.plan.adapters import plan_adapters
    from orbitctl.plan.comm import rollout_batch
    from orbitctl.plan.layout import layout_of
    from orbitctl.plan.ops import fused_int4
    from orbitctl.profile.gpus import resolve_gpu

    arch = _arch(profile)
    cpu = resolve_gpu(profile.hardware.gpu).vendor == "cpu"
    mem, rl = profile.memory, profile.rl
    sequences = min(mem.micro_batch_size, rl.prompts_per_step * rl.group_size)
    tokens = sequences * mem.seq_len
    shapes = {"device": "cpu" if cpu else "cuda", "compute_dtype": profile.quant.compute_dtype,
              "gemm": [tokens, arch.hidden_size, max(arch.hidden_size, arch.intermediate_size)],
              "rank": plan_adapters(arch, profile.adapter).rank, "group_size": profile.quant.group_size,
              "fused": fused_int4(profile.quant, profile.hardware.gpu)}
    if cpu:
        return shapes
    batch = rollout_batch(profile, mem.micro_batch_size)  # the caller resolved rollout.batch_size: auto
    if arch.num_experts:
        layout = layout_of(profile, arch.num_experts)
        group = layout.expert_parallel if layout.expert_parallel_on else 1
        # the slots one GPU's held experts receive: every rank's tokens x top-k, its share E_held / E of them; as rows
        # that each pick top-k of the held experts
        share = group * layout.experts_per_rank / arch.num_experts
        shapes["experts"] = {"held": layout.experts_per_rank, "hidden": arch.hidden_size,
                             "width": arch.moe_intermediate_size, "top_k": arch.experts_per_token,
                             "decode_rows": max(1, round(batch * share)), "update_rows": max(1, round(tokens * share))}
    kv_heads = 1 if arch.attention == "mla" else arch.num_kv_heads
    width = arch.kv_lora_rank + arch.qk_rope_head_dim if arch.attention == "mla" else arch.head_dim
    shapes["attention"] = {"batch": batch, "kv_heads": kv_heads, "head_dim": width, "context": mem.seq_len}
    return shapes


def calibrate(profile, out: str | Path) -> Path:
    """Measure ``profile``'s kernels here (module docstring) and write the calibration file ``out``."""
    from orbitctl.profile.calibration import write_calibration
    from orbitctl.profile.gpus import resolve_gpu

    spec = resolve_gpu(profile.hardware.gpu)
    shapes = kernel_shapes(profile)
    env = dict(os.environ)
    if shapes["device"] == "cpu":
        env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    with tempfile.TemporaryDirectory(prefix="orbitctl-calibrate-") as tmp:
        if shapes["device"] == "cpu":  # the host's rates use the profile's own tokenizer and prompts
            from orbitctl.profile.loader import dump_profile

            shapes["profile"] = str(Path(tmp) / "profile.yaml")
            Path(shapes["profile"]).write_text(dump_profile(profile), encoding="utf-8")
        path = Path(tmp) / "shapes.json"
        path.write_text(json.dumps(shapes), encoding="utf-8")
        try:
            done = subprocess.run([sys.executable, "-m", "orbitctl.rl.kernelrates", str(path)], capture_output=True,
                                  text=True, env=env, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"--calibrate: the measurements took over {TIMEOUT_S} s",
                            fix="run it on an idle machine") from None
    lines = done.stdout.strip().splitlines()
    got = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    if done.returncode != 0 or "rates" not in got:
        last = got.get("error") or (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "no CUDA device" in last:
            raise UserError(f"--calibrate measures the profile's GPU ({spec.name}); this machine has none visible",
                            fix=f"run it on a {spec.name} machine, or calibrate a CPU profile (hardware.gpu: cpu)")
        raise RunFailed(f"--calibrate: the measurements failed: {last}", fix="run with ORBITCTL_DEBUG=1 to see why")
    if spec.vendor != "cpu" and spec.marketing.split()[0].upper() not in got["device"].upper():
        raise UserError(f"--calibrate: this machine's GPU is {got['device']}; the profile plans {spec.marketing}",
                        fix=f"calibrate on a {spec.name} machine, or set hardware.gpu to this GPU's catalog entry")
    from importlib.metadata import PackageNotFoundError, version

    try:
        orbitctl_version = version("orbitctl")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        orbitctl_version = "unknown"
    shapes.pop("profile", None)  # a temporary file: the profile is named below
    doc = {"gpu": spec.name, "device": got["device"], "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "profile": profile.name, "orbitctl": orbitctl_version, "torch": got.get("torch"), "rates": got["rates"],
           "shapes": shapes, "skipped": got.get("skipped", {})}
    return write_calibration(out, doc)
