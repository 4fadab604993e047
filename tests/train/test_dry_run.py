"""`orbitctl train PROFILE --dry-run` and the shipped GPU profiles.

Every shipped GPU profile is one train builds: on this machine (no GPU) `orbitctl train PROFILE`
stops only at the machine check, exit 2 naming the GPUs it lacks, and `--dry-run`, given the model and
data files the profile names, works the whole run out (ranks, the experts each reads, the DeepSpeed config,
the memory mechanics, the plan and the machine check) without loading a weight, exit 0. Without those files
it refuses, exit 2 naming the keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orbitctl.cli.app import main

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "doctor" / "fixtures" / "snapshots"
GPU_PROFILES = sorted(p for p in (ROOT / "profiles").glob("*.yaml") if not p.stem.endswith(("-cpu", "-cpu-http")))


def test_every_gpu_profile_is_shipped():
    assert len(GPU_PROFILES) >= 6


@pytest.mark.parametrize("path", GPU_PROFILES, ids=lambda p: p.stem)
def test_train_stops_only_at_the_machine_check(path, one_error_line):
    from orbitctl.profile import load_profile

    hw = load_profile(str(path)).hardware
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, "hardware:", f"{hw.gpus_per_node} x {hw.gpu}")


@pytest.mark.parametrize("path", GPU_PROFILES, ids=lambda p: p.stem)
def test_dry_run_works_out_every_rank(path, capsys, gpu_profile_inputs):
    from orbitctl.plan import _arch
    from orbitctl.profile import load_profile

    profile = load_profile(str(path))
    assert main(["train", str(path), "--dry-run", "--json", *gpu_profile_inputs]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == profile.world_size == len(doc["ranks"])
    assert [r["rank"] for r in doc["ranks"]] == list(range(profile.world_size))
    assert {r["device"] for r in doc["ranks"]} == {f"cuda:{i}" for i in range(profile.hardware.gpus_per_node)}
    arch = _arch(profile)
    if arch.num_experts and doc["layout"]["expert_parallel"] > 1:
        # each expert-parallel group holds every routed expert exactly once
        ep = doc["layout"]["expert_parallel"]
        for group in range(profile.world_size // ep):
            held = sorted(e for r in doc["ranks"] if r["expert_group"] == group
                          for e in range(r["experts"][0], r["experts"][1] + 1))
            assert held == list(range(arch.num_experts))
    ds = doc["deepspeed_config"]
    assert ds["zero_optimization"]["stage"] == profile.memory.zero_stage
    assert ds["train_micro_batch_size_per_gpu"] == profile.memory.micro_batch_size
    assert ds["gradient_accumulation_steps"] == doc["accumulation"]["derived"]
    mem = doc["memory"]
    assert mem["loss_chunk_size"] == profile.memory.loss_chunk_size
    assert mem["offload_activations"] == profile.memory.offload_activations
    if profile.memory.offload_activations == "cpu":
        assert mem["offloaded_activation_bytes_per_node"] > 0
    assert doc["plan"]["phase_peak_bytes"] and doc["plan"]["verdict"]
    assert doc["machine_check"]["checks"] and isinstance(doc["machine_check"]["passes_here"], bool)


def test_dry_run_text_names_what_it_builds(capsys, gpu_profile_inputs):
    kimi = ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"
    assert main(["train", str(kimi), "--dry-run", *gpu_profile_inputs]) == 0
    out = capsys.readouterr().out
    for needle in ("ranks", "cuda:7", "336..383", "loss_chunk_size", "offload_activations", "DeepSpeed config",
                   "policy_update", "machine check"):
        assert needle in out, needle


def test_dry_run_reports_the_machine_check_against_a_snapshot():
    from orbitctl.doctor.snapshot import load_snapshot
    from orbitctl.launch.dryrun import dry_run
    from orbitctl.profile import load_profile

    snap = load_snapshot(SNAPSHOTS / "healthy_8xh100.json")
    qwen = load_profile(str(ROOT / "profiles" / "qwen3-235b-a22b_grpo_int4_8xh100.yaml"))
    assert dry_run(qwen, snapshot=snap).machine_check["passes_here"] is True
    kimi = load_profile(str(ROOT / "profiles" / "kimi-k2_grpo_int4_8xh200.yaml"))
    check = dry_run(kimi, snapshot=snap).machine_check
    assert check["passes_here"] is False and "8 x h200" in check["message"]


def test_dry_run_refuses_what_train_refuses(one_error_line, capsys):
    tiny = str(ROOT / "profiles" / "tiny-cpu.yaml")
    assert main(["train", tiny, "--dry-run", "--set", "rollout.engine=separate"]) == 2
    one_error_line(capsys.readouterr().err, "rollout.engine")
    # a batch that does not split over the ranks is refused as train refuses it
    assert main(["train", tiny, "--dry-run", "--set", "memory.micro_batch_size=7"]) == 2
    one_error_line(capsys.readouterr().err, "memory.micro_batch_size")


def test_dry_run_of_the_cpu_moe_places_the_experts_as_the_ranks_do(capsys):
    """The tiny MoE's two CPU ranks: each reads the experts its ExpertGroup owns (the code the ranks run)."""
    from orbitctl.model.expert_parallel import ExpertGroup

    tiny = str(ROOT / "profiles" / "tiny-moe-cpu.yaml")
    assert main(["train", tiny, "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["device"] for r in doc["ranks"]] == ["cpu"] * doc["world_size"]
    assert doc["machine_check"]["passes_here"] is True
    experts = doc["layout"]["routed_experts"]
    for r in doc["ranks"]:
        owned = ExpertGroup(r["expert_rank"], doc["layout"]["expert_parallel"]).owned(experts)
        assert r["experts"] == [owned.start, owned.stop - 1]


@pytest.mark.parametrize("path", GPU_PROFILES, ids=lambda p: p.stem)
def test_dry_run_refuses_the_model_and_data_it_cannot_find(path, one_error_line, tmp_path):
    """As shipped, the GPU profiles name /models/... and data/math_train.jsonl, absent here: one line naming
    each key, exit 2, from any working directory."""
    done = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "train", str(path), "--dry-run"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr
    one_error_line(done.stderr, "model.quantized_path:", "model.path:", "data.train: data/math_train.jsonl does not exist",
                   f"(from {tmp_path})", "orbitctl quantize PROFILE", "docs/train.md")


def test_dry_run_checks_the_model_train_would_read(tmp_path, one_error_line, capsys):
    """model.quantized_path is used as is (model.path then unread); without it model.path must hold a checkpoint."""
    tiny = str(ROOT / "profiles" / "tiny-cpu.yaml")
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    cases = [
        (["model.path=" + str(tmp_path / "missing")], "model.path: " + str(tmp_path / "missing") + " does not exist"),
        (["model.path=" + str(tmp_path)], "has neither a config.json nor a GGUF file"),
        (["model.quantized_path=" + str(checkpoint), "model.path=" + str(tmp_path)],
         "model.quantized_path: " + str(checkpoint) + " holds no quantized base"),
        (["data.eval=" + str(tmp_path / "eval.jsonl")], "data.eval: " + str(tmp_path / "eval.jsonl") + " does not exist"),
        (["model.path=pkg:no_such_package/model.gguf"], "package 'no_such_package'"),
    ]
    for sets, needle in cases:
        assert main(["train", tiny, "--dry-run", *[a for s in sets for a in ("--set", s)]]) == 2, sets
        one_error_line(capsys.readouterr().err, needle)
    (checkpoint / "config.json").write_text("{}")  # quantized: model.path is not read, even where it is missing
    sets = ["model.quantized_path=" + str(checkpoint), "model.path=" + str(tmp_path / "missing")]
    assert main(["train", tiny, "--dry-run", "--json", *[a for s in sets for a in ("--set", s)]]) == 0
    capsys.readouterr()


def test_train_checks_the_files_after_the_machine(tmp_path, one_error_line, capsys):
    """train itself refuses a missing data file before it starts anything (a CPU profile has no machine check)."""
    tiny = str(ROOT / "profiles" / "tiny-cpu.yaml")
    assert main(["train", tiny, "--set", f"data.train={tmp_path / 'nope.jsonl'}", "--set", f"run.dir={tmp_path / 'run'}"]) == 2
    one_error_line(capsys.readouterr().err, "data.train:", "does not exist")
    assert not (tmp_path / "run").exists()
