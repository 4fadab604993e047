"""Every bad input ends with exit code 2 and one `Error:` line naming the file and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from orbitctl.cli.app import main


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _run(capsys, *args) -> tuple[int, str]:
    code = main(["quantize", *map(str, args)])
    err = capsys.readouterr().err
    return code, err


def _one_clear_line(err: str, *needles: str) -> None:
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_missing_checkpoint_directory(capsys, tmp_path):
    code, err = _run(capsys, tmp_path / "nope", tmp_path / "out", "--format", "nf4")
    assert code == 2
    _one_clear_line(err, "nope", "checkpoint directory not found")


def test_no_safetensors_files(capsys, tiny_models, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tiny_models["llama"] / "config.json", src)
    code, err = _run(capsys, src, tmp_path / "out", "--format", "nf4")
    assert code == 2
    _one_clear_line(err, str(src), "no *.safetensors")


def test_truncated_shard(capsys, tiny_models, tmp_path):
    src = _copy(tiny_models["llama"], tmp_path / "src")
    shard = sorted(src.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = _run(capsys, src, tmp_path / "out", "--format", "int4")
    assert code == 2
    _one_clear_line(err, shard.name, "truncated")
    assert not (tmp_path / "out").exists()


def test_index_names_a_missing_shard(capsys, tiny_models, tmp_path):
    src = _copy(tiny_models["qwen3_moe"], tmp_path / "src")
    missing = sorted(src.glob("model-*.safetensors"))[1]
    missing.unlink()
    code, err = _run(capsys, src, tmp_path / "out", "--format", "fp8")
    assert code == 2
    _one_clear_line(err, "model.safetensors.index.json", missing.name, "missing")


def test_unsupported_tensor_dtype(capsys, tmp_path, tiny_models):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(tiny_models["llama"] / "config.json", src)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.float64)}, src / "model.safetensors")
    code, err = _run(capsys, src, tmp_path / "out", "--format", "nf4")
    assert code == 2
    _one_clear_line(err, "model.embed_tokens.weight", "F64")


def test_unsupported_architecture(capsys, tiny_models, tmp_path):
    src = _copy(tiny_models["llama"], tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(config))
    code, err = _run(capsys, src, tmp_path / "out", "--format", "nf4")
    assert code == 2
    _one_clear_line(err, "config.json", "gpt2", "not supported")


def test_output_directory_not_empty(capsys, tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = _run(capsys, tiny_models["llama"], out, "--format", "nf4")
    assert code == 2
    _one_clear_line(err, str(out), "not empty")
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_output_directory_of_another_conversion(capsys, quantized, tiny_models):
    out = quantized("llama", "int4")
    code, err = _run(capsys, tiny_models["qwen3_moe"], out, "--format", "int4", "--group-size", "32", "--max-shard-size", "60000")
    assert code == 2
    _one_clear_line(err, str(out), "another source")


@pytest.mark.parametrize("args,needle", [(["--format", "int8"], "unknown format"),
                                         (["--format", "int4", "--group-size", "48"], "group_size"),
                                         (["--format", "nf4", "--max-shard-size", "lots"], "max-shard-size")])
def test_bad_options(capsys, tiny_models, tmp_path, args, needle):
    code, err = _run(capsys, tiny_models["llama"], tmp_path / "out", *args)
    assert code == 2
    _one_clear_line(err, needle)


def test_int4_checkpoint_is_not_requantized_to_another_format(capsys, quantized, tmp_path):
    code, err = _run(capsys, quantized("llama", "int4"), tmp_path / "out", "--format", "nf4")
    assert code == 2
    _one_clear_line(err, "already INT4", "--format int4")


def test_nf4_cannot_quantize_only_fused_experts(capsys, tiny_models, tmp_path):
    code, err = _run(capsys, tiny_models["qwen3_moe"], tmp_path / "out", "--format", "nf4", "--modules", "experts")
    assert code == 2
    _one_clear_line(err, "quant.modules", "int4 or fp8")


def test_verify_of_a_directory_without_manifest(capsys, tmp_path):
    code, err = _run(capsys, "--verify", tmp_path)
    assert code == 2
    _one_clear_line(err, "quant_manifest.json")
