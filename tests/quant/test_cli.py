"""`orbitctl quantize` stays thin: it parses flags, makes one library call and renders the result."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from orbitctl.cli.app import app, main


def test_src_out_form_passes_flags_to_the_library(monkeypatch, tmp_path):
    import orbitctl.quant.api as api

    seen = {}

    def fake(src, out, **kwargs):
        seen.update(src=src, out=out, **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(api, "run_quantize", fake)
    result = CliRunner().invoke(app, ["quantize", "in/ckpt", "out/q", "--format", "int4", "--group-size", "128",
                                      "--modules", "experts", "--skip", "lm_head", "--skip", "mtp",
                                      "--max-shard-size", "500MB", "--eval-prompts", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert seen["src"] == "in/ckpt" and seen["out"] == "out/q"
    assert (seen["fmt"], seen["group_size"], seen["modules"], seen["skip"]) == ("int4", 128, "experts", ("lm_head", "mtp"))
    assert seen["max_shard_size"] == "500MB" and seen["eval_prompts"] == 3 and seen["progress"] is None
    assert (seen["double_quant"], seen["storage_dtype"]) == (True, "bf16")


def test_profile_form_passes_the_profile_and_overrides(monkeypatch):
    import orbitctl.quant.api as api

    seen = {}
    monkeypatch.setattr(api, "quantize_profile", lambda path, ovr, **kw: seen.update(path=path, ovr=ovr, **kw) or (_ for _ in ()).throw(SystemExit(0)))
    result = CliRunner().invoke(app, ["quantize", "profiles/x.yaml", "--set", "quant.format=fp8", "--json"])
    assert result.exit_code == 0, result.output
    assert seen == {"path": "profiles/x.yaml", "ovr": ["quant.format=fp8"], "progress": None, "eval_prompts": 0}


def test_profile_run_writes_quantized_path(tiny_models, tmp_path, capsys):
    out = tmp_path / "base-int4"
    profile = tmp_path / "p.yaml"
    profile.write_text(f"name: t\nmodel: {{arch: tiny-llama, path: {tiny_models['qwen3_moe']}, quantized_path: {out}}}\n"
                       "quant: {format: int4, group_size: 32, modules: experts}\n")
    assert main(["quantize", str(profile), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # exactly one JSON document on stdout
    assert doc["output"] == str(out) and doc["format"]["group_size"] == 32
    assert "quantizing" not in captured.err  # no progress bar with --json
    assert set(doc["report"]["summary"]["quantized"]) == {"experts"}

    from orbitctl.model.frozen_base import load_frozen_base_for_profile
    from orbitctl.profile.loader import load_profile

    model = load_frozen_base_for_profile(load_profile(profile))
    assert all(not p.requires_grad for p in model.parameters())


def test_table_output_names_every_module_kind(tiny_models, tmp_path, capsys):
    assert main(["quantize", str(tiny_models["deepseek_v3"]), str(tmp_path / "o"), "--format", "fp8"]) == 0
    out = capsys.readouterr().out
    for kind in ("attention", "mlp", "shared_experts", "experts", "embedding kept", "bits/w", "SQNR dB"):
        assert kind in out


def test_profile_without_paths_is_bad_input(tmp_path, capsys):
    profile = tmp_path / "p.yaml"
    profile.write_text("name: t\nmodel: {arch: tiny-llama}\n")
    assert main(["quantize", str(profile)]) == 2
    assert "model.path is not set" in capsys.readouterr().err


def test_help_imports_no_torch():
    code = "import sys; from orbitctl.cli.app import main; main(['quantize', '--help']); assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "orbitctl quantize --verify" in done.stdout
