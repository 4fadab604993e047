"""`orbitctl export` on the command line: the report, --json, and bad input as one line with exit 2."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from orbitctl.cli.app import app, main


def test_json_report_counts_every_tensor(int4_profile, adapter_dir, tmp_path):
    result = CliRunner().invoke(app, ["export", str(int4_profile), str(tmp_path / "g"), "--format", "gguf",
                                      "--adapter", str(adapter_dir), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["counts"]["tensors"] == 21 and doc["counts"]["exact"] == 21 and doc["counts"]["by_type"]["Q4_0"] == 14
    assert doc["adapter_counts"]["tensors"] == 28
    assert sorted(doc["files"]) == ["adapter.gguf", "export_report.json", "model.gguf"]
    assert json.loads((tmp_path / "g" / "export_report.json").read_text())["counts"] == doc["counts"]


def test_the_table_names_each_tensor(int4_profile, tmp_path):
    result = CliRunner().invoke(app, ["export", str(int4_profile), str(tmp_path / "g"), "--format", "gguf"])
    assert result.exit_code == 0, result.output
    assert "blk.0.attn_q.weight" in result.stdout and "Q4_0" in result.stdout
    assert "base: 21 tensors, 21 exact, 0 converted" in result.stdout


def test_bad_format_exits_2(int4_profile, tmp_path, capsys, one_error_line):
    assert main(["export", str(int4_profile), str(tmp_path / "o"), "--format", "onnx"]) == 2
    one_error_line(capsys.readouterr().err, "--format onnx", "gguf, hf-merged")


def test_missing_adapter_dir_exits_2(int4_profile, tmp_path, capsys, one_error_line):
    assert main(["export", str(int4_profile), str(tmp_path / "o"), "--format", "gguf", "--adapter", "no/such/dir"]) == 2
    one_error_line(capsys.readouterr().err, "no/such/dir")
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture_exits_2(write_demo_profile, tmp_path, capsys, one_error_line):
    profile = write_demo_profile(tmp_path / "moe.yaml", {"model.arch": "tiny-qwen3-moe", "quant.format": "int4"})
    assert main(["export", str(profile), str(tmp_path / "o"), "--format", "gguf"]) == 2
    one_error_line(capsys.readouterr().err, "qwen3_moe", "llama, qwen2, qwen3")


def test_an_existing_out_is_refused(int4_profile, tmp_path, capsys, one_error_line):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    assert main(["export", str(int4_profile), str(tmp_path / "o"), "--format", "gguf"]) == 2
    one_error_line(capsys.readouterr().err, "already exists", "--fresh")
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"
