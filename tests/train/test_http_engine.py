"""`orbitctl train` with `rollout.engine: http`: rollouts sampled by `orbitctl serve` over real HTTP on loopback.

- The demo task is learned through the engine as through the shared one (held-out gain >= 20 points), and the
  online engine-vs-trainer mismatch stays within the kernel floor measured in the same test: the shared
  engine's own mismatch on the same profile (the trainer's infer path against its train path).
- Killing the engine mid-run fails the step with one error line naming the engine; the newest checkpoint
  stays complete, and the same command resumes from it once the engine is back on its port.
- What train cannot carry out with an http engine is refused before anything is built.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from orbitctl.profile import load_profile
from orbitctl.profile.support import TRAIN, unsupported_for
from orbitctl.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
HTTP_DEMO = ROOT / "profiles" / "tiny-cpu-http.yaml"
CLI = [sys.executable, "-c", "import sys; from orbitctl.cli.app import main; sys.exit(main())"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train(profile: Path, *extra: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    # a guard against a hang, not a speed check: the demo's 300 steps through the engine take ~10 min on an
    # AVX-512 CPU, ~15 on an AVX2 one (fp32 compute), longer on a machine shared with other work
    return subprocess.run([*CLI, "train", str(profile), "--json", *extra], capture_output=True, text=True,
                          timeout=timeout, cwd=profile.parent)


@pytest.mark.slow
def test_the_demo_is_learned_through_the_engine_within_the_kernel_floor(tmp_path, write_demo_profile):
    http = write_demo_profile(tmp_path / "http.yaml", {"name": "http", "run.dir": str(tmp_path / "http"),
                                                       "rollout.engine": "http", "rollout.engine_sleep": False})
    done = _train(http)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["steps"] == 300
    gain = result["eval_after"] - result["eval_before"]
    assert gain >= 0.20, result  # the same bar as the shared engine's demo
    records = _metrics(tmp_path / "http")
    assert all(r["update_applied"] for r in records)
    # the floor: the shared engine on the same profile, the trainer's own infer path against its train path
    shared = write_demo_profile(tmp_path / "shared.yaml", {"name": "shared", "run.dir": str(tmp_path / "shared"),
                                                           "rl.steps": 30})
    assert _train(shared).returncode == 0
    floor = max(r["mismatch_logp_abs_max"] for r in _metrics(tmp_path / "shared"))
    # where the kernels agree bitwise the floor is 0: then a few ulps of the largest log-prob the engine returns
    from orbitctl.kernels.cpu_dtype import compute_dtype_name

    dtype = torch.bfloat16 if compute_dtype_name(load_profile(http)) == "bf16" else torch.float32
    ulps = 8 * torch.finfo(dtype).eps * 10.0  # a few ulps of a log-prob of magnitude <= 10
    worst = max(r["mismatch_logp_abs_max"] for r in records)
    assert worst <= 4 * max(floor, ulps), (worst, floor)
    assert not (tmp_path / "http" / "engine.log").read_text().count("Traceback")


def _serve(profile: Path, port: int, log: Path, api_key: str | None = None) -> subprocess.Popen:
    """``orbitctl serve`` loading the trainer's adapters from under the profile's directory (the run's
    ``engine/`` is there), with ``api_key`` when given."""
    env = {k: v for k, v in os.environ.items() if k != "ORBITCTL_API_KEY"}
    if api_key is not None:
        env["ORBITCTL_API_KEY"] = api_key
    with open(log, "ab") as out:
        process = subprocess.Popen([*CLI, "serve", str(profile), "--port", str(port), "--allow-adapter-loading",
                                    "--adapter-root", str(profile.parent)], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # not left running after the test
    process.wait()
    raise AssertionError("orbitctl serve did not start")


def test_killing_the_engine_fails_the_step_and_the_same_command_resumes(tmp_path, write_demo_profile, one_error_line):
    from orbitctl.rl.engine import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    profile = write_demo_profile(tmp_path / "p.yaml", {
        "name": "http-kill", "run.dir": str(run_dir), "rl.steps": 60, "run.save_every": 4, "run.eval_every": 1000,
        "rollout.engine": "http", "rollout.engine_url": url, "rollout.engine_sleep": False,
        "rollout.engine_retries": 1, "rollout.engine_timeout_s": 10})
    server = _serve(profile, port, tmp_path / "serve.log")
    trainer = subprocess.Popen([*CLI, "train", str(profile)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path)
    run = RunDir(run_dir)
    try:
        deadline = time.monotonic() + 600
        while not any(step >= 8 for step, _ in run.complete_checkpoints()):
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read()[-2000:]
            time.sleep(0.05)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        _, err = trainer.communicate(timeout=300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    one_error_line(errors[0], f"rollout engine {url}", "after 2 attempts", "rerun the same command to resume")
    checkpoints = run.complete_checkpoints()
    newest = checkpoints[-1][0]
    assert newest >= 8 and newest < 60
    assert not list(run.root.glob("checkpoints/*.partial*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] != "finished"

    server = _serve(profile, port, tmp_path / "serve.log")
    try:
        again = _train(profile)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert again.returncode == 0, again.stderr[-2000:]
    result = json.loads(again.stdout)
    assert result["resumed_from"] == newest and result["steps"] == 60
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 61))


def test_a_keyed_engine_trains_with_the_key_and_refuses_a_trainer_without_it(tmp_path, write_demo_profile,
                                                                               one_error_line):
    import secrets

    from orbitctl.rl.engine import free_port

    key = secrets.token_urlsafe(24)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    profile = write_demo_profile(tmp_path / "p.yaml", {
        "name": "http-key", "run.dir": str(run_dir), "rl.steps": 4, "run.save_every": 2, "run.eval_every": 1000,
        "data.eval_size": 8, "rollout.engine": "http", "rollout.engine_url": url, "rollout.engine_sleep": False,
        "rollout.engine_retries": 1})
    server = _serve(profile, port, tmp_path / "serve.log", api_key=key)
    try:
        unkeyed = {k: v for k, v in os.environ.items() if k != "ORBITCTL_API_KEY"}
        refused = subprocess.run([*CLI, "train", str(profile)], capture_output=True, text=True, timeout=900,
                                 cwd=tmp_path, env=unkeyed)
        assert refused.returncode == 1, refused.stderr[-2000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("Error: ")]
        one_error_line(errors[0], f"rollout engine {url}", "HTTP 401", "ORBITCTL_API_KEY")
        done = subprocess.run([*CLI, "train", str(profile), "--json", "--fresh"], capture_output=True, text=True,
                              timeout=900, cwd=tmp_path, env={**unkeyed, "ORBITCTL_API_KEY": key})
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["steps"] == 4
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3, 4] and all(r["update_applied"] for r in _metrics(run_dir))
    # the key is in no log, event, metric or file of the run
    leaked = [p for p in [*run_dir.rglob("*"), tmp_path / "serve.log"] if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == [] and key not in done.stdout + done.stderr + refused.stdout + refused.stderr


@pytest.mark.parametrize("sets, key", [
    ({"rollout.engine_sleep": True}, "rollout.engine_sleep"),
    ({"rollout.engine_sleep": False, "data.train": "env:guess", "rollout.max_turns": 3}, "data.train"),
    ({"rollout.engine_sleep": False, "rollout.engine_tp": 2}, "rollout.engine_tp"),
    ({"rollout.engine_sleep": False, "rollout.kv_dtype": "fp8", "rollout.engine_url": "http://127.0.0.1:8000"},
     "rollout.kv_dtype"),
])
def test_what_train_does_not_carry_out_with_an_http_engine_is_refused(tmp_path, write_demo_profile, sets, key):
    profile = load_profile(write_demo_profile(tmp_path / "p.yaml", {"rollout.engine": "http", **sets}))
    assert key in [u.key for u in unsupported_for(TRAIN, profile)]
    clean = load_profile(write_demo_profile(tmp_path / "q.yaml", {"rollout.engine": "http",
                                                                  "rollout.engine_sleep": False}))
    assert unsupported_for(TRAIN, clean) == []


@pytest.mark.parametrize("sets, needle", [
    ({"rollout.engine_url": "http://127.0.0.1:8000"}, "rollout.engine_url: configures an http engine"),
    ({"rollout.engine_retries": 5}, "rollout.engine_retries: configures an http engine"),
    ({"rollout.engine": "http", "rollout.engine_url": "127.0.0.1:8000"}, "is not an http(s) URL"),
])
def test_http_engine_keys_without_an_http_engine_or_a_url_that_is_not_one_exit_2(tmp_path, write_demo_profile,
                                                                                 one_error_line, sets, needle):
    profile = write_demo_profile(tmp_path / "p.yaml", sets)
    done = subprocess.run([*CLI, "train", str(profile)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert needle in done.stderr and "Traceback" not in done.stderr
