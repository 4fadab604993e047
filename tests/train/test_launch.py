"""`orbitctl train` starts the profile's ranks itself: the tiny MoE on 2 CPU ranks with expert parallelism 2.

The machine is checked first (a profile asking for GPUs this machine lacks exits 2 before anything
loads), a failing rank's own message reaches the user, and a run whose rank was killed with
SIGKILL resumes to the same adapter as a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "profiles" / "tiny-moe-cpu.yaml"
SNAPSHOTS = ROOT / "tests" / "doctor" / "fixtures" / "snapshots"
SMALL = {"rl.prompts_per_step": 8, "rl.group_size": 4, "memory.micro_batch_size": 16, "rollout.batch_size": 16,
         "rl.steps": 6, "rl.warmup_steps": 0, "run.eval_every": 100, "run.save_every": 2, "data.eval_size": 8}


def moe_profile(tmp_path: Path, name: str, **overrides) -> Path:
    data = yaml.safe_load(MOE.read_text())
    for key, value in {**SMALL, "run.dir": str(tmp_path / name), **overrides}.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, **kw)


def _adapter_bytes(run: Path) -> bytes:
    return (run / "adapter" / "adapter_model.safetensors").read_bytes()


def test_more_gpus_than_here_exits_2_before_anything_loads(one_error_line):
    tiny = ROOT / "profiles" / "tiny-cpu.yaml"
    done = _train(tiny, "--set", "hardware.gpu=h200", "--set", "hardware.gpus_per_node=8")
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, "hardware:", "8 x h200", "hardware.gpus_per_node")


def test_the_machine_check_reads_the_gpus_the_doctor_sees():
    from orbitctl.doctor.snapshot import load_snapshot
    from orbitctl.errors import UserError
    from orbitctl.launch.fit import check_machine
    from orbitctl.profile import load_profile

    snap = load_snapshot(SNAPSHOTS / "healthy_8xh100.json")
    tiny = str(ROOT / "profiles" / "tiny-cpu.yaml")
    fits = check_machine(load_profile(tiny, ["hardware.gpu=h100-80g", "hardware.gpus_per_node=8"]), snap)
    assert fits.gpus == 8 and len(fits.numa_nodes) == 8
    with pytest.raises(UserError, match="8 x h200"):  # the plan's GPU is larger than this machine's
        check_machine(load_profile(tiny, ["hardware.gpu=h200", "hardware.gpus_per_node=8"]), snap)
    with pytest.raises(UserError, match="16 x h100-80g"):
        check_machine(load_profile(tiny, ["hardware.gpu=h100-80g", "hardware.gpus_per_node=16"]), snap)
    assert check_machine(load_profile(tiny, ["hardware.gpus_per_node=2"]), snap).gpus == 0  # CPU ranks


def test_a_failing_rank_reports_its_own_error(tmp_path, one_error_line):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3}\n')
    profile = moe_profile(tmp_path, "bad", **{"data.train": str(data), "data.reward": "math"})
    done = _train(profile)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    one_error_line(lines[0], "rank", f"{data}:2", "prompt")


@pytest.mark.slow
def test_two_ranks_train_resume_after_sigkill_to_the_same_adapter(tmp_path):
    straight = moe_profile(tmp_path, "straight")
    done = _train(straight, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["steps"] == 6 and result["rank"] == 0
    run = tmp_path / "straight"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    memory = records[-1]["phase_memory"]  # both ranks' peaks beside the plan's prediction
    assert set(memory) == {"rollout", "policy_update"}
    assert all(len(p["measured_bytes"]) == 2 and p["predicted_bytes"] > 0 for p in memory.values())

    killed = moe_profile(tmp_path, "killed")
    proc = subprocess.Popen([sys.executable, "-m", "orbitctl.cli.app", "train", str(killed), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    marker = tmp_path / "killed" / "checkpoints" / "step-2" / "COMPLETE"
    deadline = time.monotonic() + 400
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()[1][-3000:]
    launch_dir = tmp_path / "killed" / ".launch"
    workers = subprocess.run(["pgrep", "-f", f"orbitctl.launch.worker {launch_dir}"],
                             capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "rank" in err and "SIGKILL" in err, err[-3000:]
    resumed = _train(killed, "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["resumed_from"] in (2, 4)
    assert _adapter_bytes(tmp_path / "killed") == _adapter_bytes(run)


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_train_the_adapter_one_rank_trains(tmp_path):
    """3 steps on 2 ranks with EP 2 end at the adapter 3 steps on 1 rank reach, within the kernel floor,
    the routed experts' own adapters (shared-outer: factors shared by a layer's experts and factors per
    expert) included.

    The floor is measured here: the same 1-rank run with rollout and micro-batches twice as large,
    which changes only how the kernels group rows (what EP changes too, besides the order in which
    the ranks' gradients are summed). The draws are keyed by sequence, so all three runs sample the
    same tokens: their rewards agree exactly.
    """
    import torch

    common = {"rl.steps": 3, "run.save_every": 100, "quant.compute_dtype": "fp32", "adapter.dtype": "fp32",
              "rl.prompts_per_step": 4, "rl.group_size": 8, "rollout.temperature": 1.5,
              "memory.micro_batch_size": 8, "rollout.batch_size": 8,
              "adapter.experts": "shared-outer", "adapter.experts_rank": 4}
    one_rank = {"hardware.gpus_per_node": 1, "memory.expert_parallel": 1}
    profiles = {"two": moe_profile(tmp_path, "two", **common),
                "one": moe_profile(tmp_path, "one", **common, **one_rank),
                "regrouped": moe_profile(tmp_path, "regrouped", **{**common, **one_rank, "memory.micro_batch_size": 16,
                                                                  "rollout.batch_size": 16})}
    for name, profile in profiles.items():
        done = _train(profile, "--json")
        assert done.returncode == 0, (name, done.stderr[-3000:])
    runs = {name: tmp_path / name for name in profiles}
    assert _rewards(runs["two"]) == _rewards(runs["one"]) == _rewards(runs["regrouped"])
    adapters = {name: _adapter(run) for name, run in runs.items()}
    assert adapters["two"].keys() == adapters["one"].keys() and len(adapters["one"]) > 0

    def gap(a: str, b: str) -> float:
        return max(float((adapters[a][k] - adapters[b][k]).abs().max()) for k in adapters[a])

    largest = max(float(v.abs().max()) for v in adapters["one"].values())
    for part in ("self_attn", "mlp.experts"):  # B starts at zero: the 3 steps trained PEFT's and the experts' own
        assert max(float(v.abs().max()) for k, v in adapters["one"].items() if "lora_B" in k and part in k) > 0
    # a few ulps of the largest value per step, where the kernels happen to agree bitwise (summation order alone)
    ulps = 3 * 4 * torch.finfo(torch.float32).eps * largest
    floor = gap("one", "regrouped")
    assert gap("two", "one") <= 8 * max(floor, ulps), (gap("two", "one"), floor, ulps)


def test_two_ranks_report_routing_agreement_and_replay_it(tmp_path):
    """Router replay on 2 expert-parallel ranks: every step reports the routing agreement of the update's own
    routing with the rollout's, per MoE layer; an fp8 KV cache on the infer path makes them differ, the same
    kernels on both paths keep them together (the paths differ by the kernel floor only)."""
    runs = {"fp8_replay": {"rollout.kv_dtype": "fp8", "rl.router_replay": True},
            "bf16": {"rl.router_replay": False}}
    for name, overrides in runs.items():
        done = _train(moe_profile(tmp_path, name, **{"rl.steps": 3, **overrides}), "--json")
        assert done.returncode == 0, (name, done.stderr[-3000:])
    seen = {}
    for name in runs:
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "routing_agreement" in r and r.get("step")]
        assert len(steps) == 3, (name, records)
        for r in steps:
            per_layer = r["routing_agreement_per_layer"]
            assert len(per_layer) == 2 and r["routing_agreement_min_layer"] == min(per_layer)
            assert 0.5 < r["routing_agreement"] <= 1.0
        seen[name] = min(r["routing_agreement"] for r in steps)
    assert seen["bf16"] > 0.99
