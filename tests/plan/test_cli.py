"""`orbitctl plan`: exit codes, --json, --sweep, and proof that the command is thin."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from orbitctl.cli.app import app, main

REPO = Path(__file__).resolve().parents[2]
KIMI = str(REPO / "profiles" / "kimi-k2_grpo_int4_8xb200.yaml")
runner = CliRunner()


def test_fitting_profile_prints_table_and_exits_0(capsys):
    assert main(["plan", KIMI]) == 0
    out = capsys.readouterr().out
    assert "policy_update (peak)" in out and "routed_experts" in out and "FITS" in out
    assert "all_to_all_buffers" in out and "zero3_gather_rollout" in out and "base layouts" in out


def test_not_fitting_profile_exits_1_with_advice(capsys):
    assert main(["plan", KIMI, "--set", "memory.micro_batch_size=64"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "advice:" in out and "--set memory.micro_batch_size=" in out


def test_json_is_one_document(capsys):
    assert main(["plan", KIMI, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is True and doc["profile"] == "kimi-k2_grpo_int4_8xb200"
    assert doc["peak_bytes"] <= doc["usable_bytes"] and doc["max_micro_batch"] >= 4
    assert doc["communication"]["layout"] == "EP 8, dense replicated" and doc["communication"]["total_bytes"] > 0
    assert [row["best"] for row in doc["layouts"] if row["current"]] == [True]


def test_sweep_table_and_json(capsys):
    assert main(["plan", KIMI, "--sweep", "memory.micro_batch_size=1,4,64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["values"]["memory.micro_batch_size"] for r in rows] == [1, 4, 64]
    assert rows[0]["peak_bytes"] < rows[1]["peak_bytes"] < rows[2]["peak_bytes"]
    assert [r["fits"] for r in rows] == [True, True, False]
    assert main(["plan", KIMI, "--sweep", "memory.micro_batch_size=1,2", "--sweep", "memory.seq_len=1024,2048"]) == 0
    table = capsys.readouterr().out
    assert "seq_len" in table and table.count(" yes ") == 4  # every combination is a row


def test_bad_inputs_exit_2(capsys, tmp_path):
    assert main(["plan", str(tmp_path / "missing.yaml")]) == 2
    assert main(["plan", KIMI, "--sweep", "memory.micro_batch_size"]) == 2
    assert main(["plan", KIMI, "--sweep", "memory.micro_batchsize=1,2"]) == 2
    assert main(["plan", KIMI, "--set", "memory.micro_batch_size=0"]) == 2
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert "Error:" in err and "Traceback" not in err


def test_list_archs(capsys):
    assert main(["plan", "--list-archs", "--json"]) == 0
    names = {a["name"] for a in json.loads(capsys.readouterr().out)["archs"]}
    assert {"kimi-k2", "deepseek-v3", "llama-3.1-405b", "tiny-llama"} <= names


def test_cli_is_thin(monkeypatch):
    calls = []

    class Fake:
        ok, archs, sweep, measurement = True, None, None, None

        def to_dict(self):
            return {"fake": True}

    def fake_run_plan(path, overrides, **kwargs):
        calls.append((path, overrides, kwargs))
        return Fake()

    from orbitctl.plan import api

    monkeypatch.setattr(api, "run_plan", fake_run_plan)
    result = runner.invoke(app, ["plan", "x.yaml", "--set", "memory.seq_len=8", "--sweep", "memory.micro_batch_size=1,2",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"fake": True}
    result = runner.invoke(app, ["plan", "x.yaml", "--measure", "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [("x.yaml", ["memory.seq_len=8"],
                      {"sweeps": ["memory.micro_batch_size=1,2"], "measure": False, "list_archs": False,
                       "measure_time": False, "compare": None, "calibrate": False, "out": None}),
                     ("x.yaml", [], {"sweeps": [], "measure": True, "list_archs": False, "measure_time": False,
                       "compare": None, "calibrate": False, "out": None})]


def test_a_sweep_with_measure_is_refused(capsys):
    assert main(["plan", KIMI, "--sweep", "memory.micro_batch_size=1,2", "--measure"]) == 2
    assert "--measure" in capsys.readouterr().err


def test_help_shows_examples():
    result = runner.invoke(app, ["plan", "--help"])
    assert result.exit_code == 0
    assert result.stdout.count("orbitctl plan profiles/") >= 2
