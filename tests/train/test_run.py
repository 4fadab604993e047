"""Whole runs through the command line: resume after SIGKILL, NaN stop, bad data, thin CLI."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SLOW_REWARD = '''
import time
CALLS = {"n": 0}

def score(completion, answer):
    time.sleep(0.004)  # keeps each step long enough to be killed in the middle of a run
    text = completion.strip()
    return float(len(text) == 1 and text.isdigit() and (int(text) + int(answer)) % 3 == 0)

def nan_after_three_steps(completion, answer):
    CALLS["n"] += 1
    if CALLS["n"] > 16 + 3 * 32:  # the first evaluation (16 prompts), then three good steps
        return float("nan")
    return score(completion, answer)
'''


def _env(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _cmd(profile, *extra):
    return [sys.executable, "-m", "orbitctl.cli.app", "train", str(profile), "--json", *extra]


def _adapter(run_dir: Path):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(tmp_path, profile_yaml):
    import torch

    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    settings = {"rl.steps": 14, "run.save_every": 4, "data.reward": "python:slow_reward:score"}
    straight = profile_yaml("straight", **settings)
    killed = profile_yaml("killed", **settings)
    env = _env(tmp_path)
    done = subprocess.run(_cmd(straight), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["steps"] == 14

    proc = subprocess.Popen(_cmd(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "killed" / "checkpoints" / "step-8" / "COMPLETE"
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run ended before its step-8 checkpoint"
    assert not (tmp_path / "killed" / "adapter").exists(), "killed after finishing: nothing was interrupted"

    resumed = subprocess.run(_cmd(killed), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads(resumed.stdout)
    assert result["resumed_from"] in (8, 12) and result["steps"] == 14
    a, b = _adapter(tmp_path / "straight"), _adapter(tmp_path / "killed")
    assert a.keys() == b.keys()
    # bit for bit: the checkpoint restores every state the steps read (weights, fp32 master, Adam,
    # scheduler, RNGs, data cursor) and the resume runs on the run's thread count, which some CPU
    # kernels round by (test_resume_safety.py starts the resumed half on another count)
    differ = {k: int((a[k] != b[k]).sum()) for k in a if not torch.equal(a[k], b[k])}
    threads = [json.loads((tmp_path / run / "checkpoints" / "step-14" / "trainer.json").read_text())["torch_threads"]
               for run in ("straight", "killed")]
    assert not differ, f"elements that differ per tensor: {differ}; resumed from {result['resumed_from']}, " \
                       f"torch threads straight/resumed {threads}"
    assert _steps(tmp_path / "killed") == list(range(1, 15))


@pytest.mark.slow
def test_nan_rewards_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, profile_yaml):
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    profile = profile_yaml("nan", **{
        "rl.steps": 20, "run.save_every": 2, "rl.max_nonfinite_steps": 2,
        "data.reward": "python:slow_reward:nan_after_three_steps"})
    out = subprocess.run(_cmd(profile), env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert "non-finite" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout.strip() == ""
    run_dir = tmp_path / "nan"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_applied"] for r in records] == [True, True, True, False, False]
    from orbitctl.rundir import RunDir

    step, path = RunDir(run_dir).latest_checkpoint()
    assert step == 2 and (path / "COMPLETE").exists()  # step 4 failed, so it was never saved
    from safetensors.torch import load_file

    good = load_file(str(path / "adapter" / "adapter_model.safetensors"))
    assert all(bool(t.float().isfinite().all()) for t in good.values())
    assert not any(p.name.startswith(".tmp-") for p in (run_dir / "checkpoints").iterdir())


def test_malformed_data_fails_before_the_run_starts(tmp_path, profile_yaml):
    from orbitctl.cli.app import main

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3}\n')
    profile = profile_yaml("bad", **{"data.train": str(data), "data.reward": "math"})
    assert main(["train", str(profile)]) == 2
    assert not (tmp_path / "bad").exists()


def test_cli_is_thin(tmp_path, monkeypatch, profile_yaml):
    from orbitctl.cli.app import main
    from orbitctl.rl import api as trainer

    seen = {}

    def fake_train(profile, *, fresh, steps, on_event):
        seen.update(profile=profile, fresh=fresh, steps=steps, on_event=on_event)
        return trainer.TrainResult(str(tmp_path), 5, None, 0.25, 0.5, 1.0, str(tmp_path / "adapter"), "lora", 0)

    monkeypatch.setattr(trainer, "train", fake_train)
    profile = profile_yaml("thin")
    assert main(["train", str(profile), "--steps", "5", "--fresh", "--json", "--set", "rl.lr=0.01"]) == 0
    assert seen["fresh"] is True and seen["steps"] == 5 and seen["on_event"] is None
    assert seen["profile"].rl.lr == 0.01


def test_help_does_not_import_torch():
    code = "import sys\nfrom orbitctl.cli.app import main\nmain(['train', '--help'])\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip().endswith("False")
    assert "orbitctl train profiles/tiny-cpu.yaml" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"rl.algorithm": "ppo", "rl.ppo_epochs": 2, "rl.minibatches": 2},
    {"rl.is_correction.kind": "icepop", "rl.kl_ref_coef": 0.05},
    {"memory.zero_stage": 3},
    {"memory.zero_stage": 0, "rl.lr_schedule": "cosine", "rl.warmup_steps": 1, "rl.align_loss.kind": "none"},
    {"adapter.kind": "bottleneck", "adapter.rank": "auto"},
    {"quant.format": "int4", "quant.group_size": 32},
    {"quant.format": "fp8", "memory.zero_stage": 3},
], ids=["ppo-2x2", "icepop-refkl", "zero3", "zero0-cosine-noalign", "bottleneck", "lora-on-int4", "lora-on-fp8-zero3"])
def test_profile_variants_train(small_profile, overrides):
    from orbitctl.rl.api import train

    result = train(small_profile(**overrides))
    records = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and result.steps == 3
    assert all(r["update_applied"] for r in records)
    assert (records[-1]["ref_kl"] is not None) == (overrides.get("rl.kl_ref_coef", 0) > 0)
    assert (records[-1]["align_loss"] is None) == (overrides.get("rl.align_loss.kind") == "none")
    if overrides.get("rl.lr_schedule") == "cosine":
        assert records[0]["lr"] == pytest.approx(1e-3) and records[-1]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert (Path(result.run_dir) / "adapter").is_dir()


@pytest.mark.slow
def test_two_ranks_shard_prompts_and_report_once(tmp_path, profile_yaml):
    profile = profile_yaml("two", **{"rl.steps": 4, "run.save_every": 2, "hardware.gpus_per_node": 2})
    env = {k: v for k, v in _env(tmp_path).items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "orbitctl.cli.app",
           "train", str(profile), "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)  # exactly one document: only rank 0 reports
    assert result["steps"] == 4
    run_dir = tmp_path / "two"
    checkpoint = run_dir / "checkpoints" / "step-4"
    assert (checkpoint / "rng-rank0.safetensors").exists() and (checkpoint / "rng-rank1.safetensors").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # 8 prompts x 4 completions per step, counted over both ranks
    assert [r["samples"] for r in records] == [32, 64, 96, 128]


def test_jsonl_data_with_user_reward_on_the_tiny_model(tmp_path, small_profile, monkeypatch):
    from orbitctl.rl.api import train

    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(5) for b in range(5)))
    (tmp_path / "exact_reward.py").write_text("def score(completion, answer):\n    return float(completion.strip() == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = train(small_profile(**{"data.train": str(data), "data.reward": "python:exact_reward:score",
                                    "data.eval_fraction": 0.2, "rollout.max_new_tokens": 3}))
    assert result.steps == 3 and result.eval_before is not None
    summary = json.loads((Path(result.run_dir) / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["eval_before"] == result.eval_before
    sys.modules.pop("exact_reward", None)
