"""Every kind of profile mistake is reported at once, as FILE: key.path: message (got VALUE), exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orbitctl.cli.app import main
from orbitctl.errors import ProfileError
from orbitctl.profile import load_profile

MINIMAL = "name: t\nmodel: {arch: tiny-llama}\n"


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(path: Path, overrides=()) -> list[str]:
    with pytest.raises(ProfileError) as info:
        load_profile(path, list(overrides))
    return info.value.problems


def test_minimal_profile_gets_the_method_defaults(tmp_path):
    profile = load_profile(write(tmp_path, MINIMAL))
    assert profile.memory.micro_batch_size == 8
    assert profile.memory.gradient_accumulation_steps == 16
    assert profile.memory.zero_stage == 3  # optimizer-state sharding on
    assert profile.adapter.rank == 256
    assert profile.rl.align_loss.weight == 0.1
    assert profile.memory.max_hbm_utilization == 0.90
    assert profile.alignment.js_max == 0.05
    assert profile.alignment.logit_l1_max == 0.1
    assert profile.alignment.entropy_fluctuation_max == 0.05
    assert profile.alignment.entropy_window == 100
    assert profile.rl.warmup_steps == 1000
    assert profile.rl.grad_clip == 1.0


def test_missing_file(tmp_path):
    probs = problems_of(tmp_path / "nope.yaml")
    assert probs == ["file not found; check the path (shipped profiles are in profiles/)"]


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "name: t\nmodel:\n  arch: [llama\nhardware: {gpu: h200}\n")
    (problem,) = problems_of(path)
    assert "YAML syntax error" in problem
    assert "line 4" in problem or "line 3" in problem


def test_unknown_key_suggests_the_closest(tmp_path):
    path = write(tmp_path, MINIMAL + "memory: {micro_bach_size: 4}\n")
    assert problems_of(path) == ["memory.micro_bach_size: unknown key; did you mean 'memory.micro_batch_size'?"]


def test_unknown_top_level_section(tmp_path):
    (problem,) = problems_of(write(tmp_path, MINIMAL + "hardwre: {gpu: h200}\n"))
    assert problem == "hardwre: unknown key; did you mean 'hardware'?"


def test_wrong_type(tmp_path):
    (problem,) = problems_of(write(tmp_path, MINIMAL + "rl: {lr: fast}\n"))
    assert problem.startswith("rl.lr: ")
    assert "(got 'fast')" in problem


def test_out_of_range(tmp_path):
    (problem,) = problems_of(write(tmp_path, MINIMAL + "adapter: {rank: 0}\n"))
    assert problem == "adapter.rank: must be >= 1 or 'auto' (got 0)"
    (problem,) = problems_of(write(tmp_path, MINIMAL + "memory: {max_hbm_utilization: 1.5}\n"))
    assert problem.startswith("memory.max_hbm_utilization: must be less than or equal to 1")
    assert problem.endswith("(got 1.5)")


def test_unknown_gpu_and_arch(tmp_path):
    path = write(tmp_path, "name: t\nmodel: {arch: tiny-lama}\nhardware: {gpu: h2000}\n")
    probs = problems_of(path)
    assert "model.arch: unknown architecture 'tiny-lama'; did you mean 'tiny-llama'? (got 'tiny-lama')" in probs
    assert any(p.startswith("hardware.gpu: unknown GPU 'h2000'") for p in probs)


def test_contradictory_settings(tmp_path):
    path = write(tmp_path, MINIMAL + "memory: {gradient_checkpointing: false, offload_activations: cpu}\n")
    (problem,) = problems_of(path)
    assert problem.startswith("memory.offload_activations: 'cpu' needs memory.gradient_checkpointing: true")
    path = write(tmp_path, MINIMAL + "memory: {zero_stage: 2, offload_params: cpu, offload_optimizer: cpu}\n")
    assert problems_of(path) == ["memory.offload_params: 'cpu' needs memory.zero_stage: 3"]
    path = write(tmp_path, MINIMAL + "rl: {algorithm: grpo, group_size: 1}\n")
    (problem,) = problems_of(path)
    assert problem.startswith("rl.group_size: GRPO needs at least 2")
    path = write(tmp_path, MINIMAL + "quant: {format: int4, group_size: 48}\n")
    assert problems_of(path) == ["quant.group_size: int4 supports 32, 64 or 128"]


def test_model_needs_exactly_one_source(tmp_path):
    (problem,) = problems_of(write(tmp_path, "name: t\nmodel: {quantized_path: /ckpt-nf4}\n"))
    assert "set model.arch" in problem and "model.path" in problem
    (problem,) = problems_of(write(tmp_path, "name: t\nmodel: {arch: tiny-llama, config: c.json}\n"))
    assert "either model.arch or model.config" in problem


def test_every_error_reported_at_once(tmp_path):
    path = write(tmp_path, """\
        name: t
        model: {arch: tiny-llama}
        hardware: {gpu: h200, gpus_per_nodes: 2}
        memory: {micro_batch_size: 0, seq_len: long}
        rl: {lr: -1}
        """)
    probs = problems_of(path)
    keys = {p.split(":")[0] for p in probs}
    assert keys == {"hardware.gpus_per_nodes", "memory.micro_batch_size", "memory.seq_len", "rl.lr"}


def test_set_overrides_apply_and_are_validated(tmp_path):
    path = write(tmp_path, MINIMAL)
    profile = load_profile(path, ["memory.micro_batch_size=4", "rl.align_loss.weight=0.2", "hardware.gpu=b200"])
    assert profile.memory.micro_batch_size == 4
    assert profile.rl.align_loss.weight == 0.2
    assert profile.hardware.gpu == "b200"
    probs = problems_of(path, ["memory.micro_batch=4", "memory.seq_len=0", "oops"])
    assert "--set memory.micro_batch: unknown key; did you mean 'memory.micro_batch_size'?" in probs
    assert "--set oops: expected KEY.PATH=VALUE, e.g. memory.micro_batch_size=4" in probs
    assert any(p.startswith("memory.seq_len: must be greater than or equal to 8") for p in probs)


def test_cli_prints_one_line_per_problem_without_traceback(tmp_path, capsys):
    path = write(tmp_path, MINIMAL + "memory: {micro_batch_size: 0}\nadapter: {rnk: 8}\n")
    code = main(["profile", "validate", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"Error: {path}: ")
    assert f"{path}: memory.micro_batch_size: must be greater than or equal to 1 (got 0)" in err
    assert f"{path}: adapter.rnk: unknown key; did you mean 'adapter.rank'?" in err
    assert "Traceback" not in err


def test_debug_env_shows_the_traceback(tmp_path):
    path = write(tmp_path, MINIMAL + "memory: {micro_batch_size: 0}\n")
    env = dict(os.environ, ORBITCTL_DEBUG="1")
    proc = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "profile", "validate", str(path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    env["ORBITCTL_DEBUG"] = ""
    proc = subprocess.run([sys.executable, "-m", "orbitctl.cli.app", "profile", "validate", str(path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
