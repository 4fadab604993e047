"""Killing the converter mid-run and running it again gives the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orbitctl.cli.app import main


def _cli(src, out, *extra, env=None):
    cmd = [sys.executable, "-m", "orbitctl.cli.app", "quantize", str(src), str(out), "--format", "nf4",
           "--max-shard-size", "60KB", "--json", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.slow
def test_killed_run_resumes_to_identical_bytes(tiny_models, tmp_path):
    src = tiny_models["deepseek_v3"]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    proc = _cli(src, clean)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    first = json.loads(proc.stdout.read())
    assert first["shards"] >= 3 and first["resumed_shards"] == 0

    proc = _cli(src, killed, env={"ORBITCTL_QUANTIZE_PAUSE_AFTER_SHARD_S": "30"})
    progress = killed / ".orbitctl-quantize-progress.jsonl"
    deadline = time.monotonic() + 90
    while not (progress.exists() and progress.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, "converter ended before the kill"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (killed / "quant_manifest.json").exists()
    assert (killed / ("model-00001-of-%05d.safetensors" % first["shards"])).exists()
    (killed / ("model-00002-of-%05d.safetensors.partial" % first["shards"])).write_bytes(b"torn write")
    assert main(["quantize", "--verify", str(killed)]) == 2

    proc = _cli(src, killed)
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    second = json.loads(proc.stdout.read())
    assert second["resumed_shards"] >= 1 and second["shards"] == first["shards"]
    assert _files(killed) == _files(clean)
    assert main(["quantize", "--verify", str(killed)]) == 0


def test_verify_detects_a_changed_shard(quantized, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(quantized("llama", "int4"), out)
    assert main(["quantize", "--verify", str(out)]) == 0
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["quantize", "--verify", str(out)]) == 1


def test_rerun_of_a_finished_conversion_does_no_work(tiny_models, tmp_path):
    from orbitctl.quant.convert import quantize_checkpoint

    out = tmp_path / "o"
    first = quantize_checkpoint(tiny_models["llama"], out, fmt="fp8", max_shard_bytes=60_000)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = quantize_checkpoint(tiny_models["llama"], out, fmt="fp8", max_shard_bytes=60_000)
    assert again.resumed_shards == again.shards == first.shards
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert again.report == first.report
