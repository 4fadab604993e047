"""Every `orbitctl quantize` flag and `--set` key takes effect or is refused (exit 2, naming it)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from orbitctl.cli.app import app, main


def _run(capsys, *args) -> tuple[int, str]:
    code = main(["quantize", *map(str, args)])
    return code, capsys.readouterr().err


def _written_group_size(out) -> tuple[int, int]:
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    manifest = json.loads((out / "quant_manifest.json").read_text())
    group = next(iter(config["config_groups"].values()))["weights"]["group_size"]
    return group, manifest["options"]["group_size"]


def test_src_out_set_quant_key_takes_effect(capsys, tiny_models, tmp_path):
    out = tmp_path / "out"
    code, err = _run(capsys, tiny_models["llama"], out, "--format", "int4", "--set", "quant.group_size=32", "--json")
    assert code == 0, err
    assert _written_group_size(out) == (32, 32)


def test_src_out_set_format_stands_in_for_the_flag(capsys, tiny_models, tmp_path):
    out = tmp_path / "out"
    code, err = _run(capsys, tiny_models["llama"], out, "--set", "quant.format=int4", "--set", "quant.group_size=128",
                     "--json")
    assert code == 0, err
    assert _written_group_size(out) == (128, 128)


@pytest.mark.parametrize("args, needles", [
    (["--format", "int4", "--set", "memory.seq_len=8"], ["--set memory.seq_len", "quant.*"]),
    (["--format", "int4", "--set", "quant.grup_size=32"], ["quant.grup_size", "quant.group_size"]),
    (["--format", "int4", "--set", "quant.group_size=48"], ["quant.group_size"]),
    (["--format", "nf4", "--set", "quant.group_size=4096"], ["--set quant.group_size", "1024"]),
    (["--format", "int4", "--set", "quant.modules=some"], ["--set quant.modules"]),
    (["--format", "int4", "--group-size", "64", "--set", "quant.group_size=32"], ["--group-size 64", "quant.group_size=32"]),
    (["--format", "fp8", "--group-size", "32"], ["--group-size", "fp8"]),
    (["--format", "int4", "--double-quant"], ["--double-quant", "int4"]),
    (["--format", "int4", "--storage-dtype", "uint8"], ["--storage-dtype", "int4"]),
    (["--format", "none", "--skip", "mlp"], ["--skip", "none"]),
    (["--format", "fp8", "--set", "quant.double_quant=true"], ["--set quant.double_quant", "fp8"]),
    (["--format", "nf4", "--set", "quant.compute_dtype=auto"], ["quant.compute_dtype", "auto"]),
])
def test_src_out_refuses_what_it_cannot_apply(capsys, tiny_models, tmp_path, args, needles, one_error_line):
    code, err = _run(capsys, tiny_models["llama"], tmp_path / "out", *args)
    assert code == 2
    one_error_line(err, *needles)
    assert not (tmp_path / "out").exists()


def test_src_out_passes_set_compute_dtype(monkeypatch):
    import orbitctl.quant.api as api

    seen = {}
    monkeypatch.setattr(api, "run_quantize", lambda src, out, **kw: seen.update(kw) or (_ for _ in ()).throw(SystemExit(0)))
    result = CliRunner().invoke(app, ["quantize", "in", "out", "--format", "nf4", "--set", "quant.compute_dtype=fp16",
                                      "--set", "quant.skip=[lm_head, mtp]", "--no-double-quant", "--json"])
    assert result.exit_code == 0, result.output
    assert (seen["compute_dtype"], seen["skip"], seen["double_quant"]) == ("float16", ("lm_head", "mtp"), False)
    assert "max_shard_size" not in seen  # the converter's own default


def _profile(tmp_path, source, out, quant="{format: int4}") -> str:
    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\nmodel: {{arch: tiny-llama, path: {source}, quantized_path: {out}}}\nquant: {quant}\n")
    return str(path)


def test_profile_mode_flags_take_effect(capsys, tiny_models, tmp_path):
    out = tmp_path / "base"
    profile = _profile(tmp_path, tiny_models["llama"], out)
    code, err = _run(capsys, profile, "--group-size", "32", "--max-shard-size", "60KB", "--json")
    assert code == 0, err
    assert _written_group_size(out) == (32, 32)
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert manifest["options"]["max_shard_bytes"] == 60_000 and len(list(out.glob("model-*.safetensors"))) > 1


def test_profile_mode_flags_become_quant_overrides(monkeypatch):
    import orbitctl.quant.api as api

    seen = {}
    monkeypatch.setattr(api, "quantize_profile", lambda path, ovr, **kw: seen.update(ovr=ovr, **kw) or (_ for _ in ()).throw(SystemExit(0)))
    result = CliRunner().invoke(app, ["quantize", "p.yaml", "--format", "nf4", "--group-size", "128", "--no-double-quant",
                                      "--storage-dtype", "uint8", "--modules", "all-linear", "--skip", "lm_head",
                                      "--skip", "mtp", "--max-shard-size", "1GB", "--eval-prompts", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert seen["ovr"] == ['quant.format="nf4"', "quant.group_size=128", "quant.double_quant=false",
                           'quant.storage_dtype="uint8"', 'quant.modules="all-linear"', 'quant.skip=["lm_head", "mtp"]']
    assert (seen["max_shard_size"], seen["eval_prompts"]) == ("1GB", 2)


@pytest.mark.parametrize("args, needles", [
    (["--set", "rl.lr=0.1"], ["--set rl.lr", "quant.*"]),
    (["--set", "quant.grup_size=32"], ["quant.grup_size"]),
    (["--group-size", "32", "--set", "quant.group_size=64"], ["--group-size", "quant.group_size"]),
    (["--format", "fp8", "--group-size", "32"], ["quant.group_size", "fp8"]),
    (["--set", "quant.format=int4", "--set", "quant.double_quant=true"], ["quant.double_quant", "int4"]),
])
def test_profile_mode_refuses_what_it_cannot_apply(capsys, tiny_models, tmp_path, args, needles, one_error_line):
    out = tmp_path / "base"
    code, err = _run(capsys, _profile(tmp_path, tiny_models["llama"], out, "{format: nf4}"), *args)
    assert code == 2
    one_error_line(err, *needles)
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["--group-size", "32"], "--group-size"),
    (["--set", "quant.group_size=32"], "--set"),
    (["--eval-prompts", "2"], "--eval-prompts"),
    (["--max-shard-size", "1GB"], "--max-shard-size"),
    (["some/src"], "PROFILE | SRC"),
])
def test_verify_takes_nothing_else(capsys, quantized, args, needle, one_error_line):
    code, err = _run(capsys, "--verify", quantized("llama", "int4"), *args)
    assert code == 2
    one_error_line(err, "--verify", needle)
