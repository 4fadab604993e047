"""benchmarks/device_check.py off a GPU (--cpu-rehearsal): every step leaves a whole record, none fails on a CPU,
and a run killed part-way keeps the records of the steps it finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.py"
STEPS = ("grouped", "graphed_layer", "sampling", "collectives", "tinygemm", "calibration")
KEYS = {"step", "status", "reason", "criterion", "figures", "seconds", "device"}


def _run(out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu-rehearsal", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _check_record(out: Path, step: str) -> dict:
    record = json.loads((out / f"{step}.json").read_text())
    assert KEYS <= set(record), record
    assert record["step"] == step
    assert record["status"] in {"pass", "fail", "skip"}, record
    if record["status"] != "pass":
        assert record["reason"].strip(), record
    assert record["criterion"].strip() or record["status"] == "skip", record
    assert isinstance(record["figures"], dict) and record["seconds"] >= 0 and record["device"] != "?"
    assert record["status"] != "fail", f"{step} failed on the CPU: {record['reason']}"
    return record


def _no_temporaries(out: Path) -> None:
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_cheap_steps_write_their_records(tmp_path):
    done = _run(tmp_path, "--only", "sampling,collectives")
    assert done.returncode == 0, done.stdout + done.stderr
    for step in ("sampling", "collectives"):
        assert _check_record(tmp_path, step)["status"] == "pass"
    lines = [line for line in done.stdout.splitlines() if line.split()[:1] in (["sampling"], ["collectives"])]
    assert len(lines) == 2 and all(" PASS " in line for line in lines), done.stdout  # one line per step
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] and summary["counts"] == {"pass": 2, "fail": 0, "skip": 0}
    assert list(summary["results"]) == ["sampling", "collectives"]
    collectives = json.loads((tmp_path / "collectives.json").read_text())["figures"]
    assert "No backend type associated with device type cpu" in collectives["cpu_refused"]
    assert not (tmp_path / "grouped.json").exists()  # --only ran those two only
    _no_temporaries(tmp_path)


def test_a_killed_run_keeps_the_finished_steps(tmp_path):
    run = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-rehearsal", "--out", str(tmp_path), "--only",
                            "collectives,sampling"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "collectives.json").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the first step never wrote its record"
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the run's own session: the parent and its step's process
        run.wait()
    assert _check_record(tmp_path, "collectives")["status"] == "pass"
    summary = json.loads((tmp_path / "summary.json").read_text())  # whole, at whichever update the kill found
    assert summary["steps"] == ["collectives", "sampling"] and not summary.get("counts")
    for path in tmp_path.glob("*.json"):
        json.loads(path.read_text())  # every record on disk is whole


def test_unknown_step_is_a_usage_error(tmp_path):
    done = _run(tmp_path, "--only", "sampling,nope", timeout=60)
    assert done.returncode == 2 and "unknown step(s) nope" in done.stderr


@pytest.mark.slow
def test_every_step_runs_or_skips_on_the_cpu(tmp_path):
    started = time.monotonic()
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {step: _check_record(tmp_path, step) for step in STEPS}
    assert records["graphed_layer"]["status"] == "skip" and "GPU" in records["graphed_layer"]["reason"]
    if records["grouped"]["status"] == "pass":  # skipped where Triton is not installed
        assert records["grouped"]["figures"]["decode"]["rel_err_gate_up"] <= 2 ** -7
    # the calibration step writes the file plan --calibrate writes, through the same code: a profile can name it
    calibration = json.loads((tmp_path / "calibration-cpu.json").read_text())
    assert records["calibration"]["status"] == "pass" and calibration["format"] == "orbitctl-calibration"
    from orbitctl.profile import load_profile

    load_profile(str(ROOT / "profiles" / "tiny-cpu.yaml"), [f"hardware.calibration={tmp_path / 'calibration-cpu.json'}"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] and summary["counts"]["fail"] == 0 and list(summary["results"]) == list(STEPS)
    _no_temporaries(tmp_path)
    assert time.monotonic() - started < 180
