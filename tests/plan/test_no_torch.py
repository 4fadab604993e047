"""`orbitctl plan` never imports torch (or any heavy library)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import io, json, sys, contextlib
from orbitctl.cli.app import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    code = main(["plan", sys.argv[1]] + sys.argv[2:])
heavy = sorted(m for m in ("torch", "transformers", "deepspeed", "peft", "bitsandbytes", "safetensors", "pynvml")
               if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy, "out": buf.getvalue()}))
"""


def _run(*args):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plan_kimi_b200_imports_no_heavy_module():
    result = _run(str(REPO / "profiles" / "kimi-k2_grpo_int4_8xb200.yaml"))
    assert result["code"] == 0
    assert result["heavy"] == []
    assert "zero3_gather" in result["out"] and "FITS" in result["out"]


def test_plan_json_and_sweep_import_no_heavy_module():
    result = _run(str(REPO / "profiles" / "deepseek-v3_grpo_int4_8xh200.yaml"), "--json",
                  "--sweep", "memory.micro_batch_size=1,2")
    assert result["heavy"] == []
    assert len(json.loads(result["out"])["sweep"]) == 2
