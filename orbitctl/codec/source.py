"""A Hugging Face checkpoint directory opened for streaming: config, shards, tensors.

(A GGUF file opens as a :class:`~orbitctl.codec.gguf_source.GGUFCheckpoint` with the same interface.)

Everything is checked before any work starts, so bad input fails in the first second with
one line: a missing or truncated shard, an index naming a file that is not there, a tensor
dtype or architecture the converter does not handle. Tensors are then read one at a time;
FP8 block-quantized weights (DeepSeek-V3, Kimi-K2 base) come back dequantized.
"""

from __future__ import annotations

from pathlib import Path

from orbitctl.codec.checkpoint import Checkpoint
from orbitctl.codec.safetensors_io import TensorEntry, read_header
from orbitctl.errors import InputFileError, UserError
from orbitctl.rundir import read_json

INDEX_NAME = "model.safetensors.index.json"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")
FLOAT_DTYPES = ("F32", "F16", "BF16")


def open_checkpoint(src: str | Path) -> Checkpoint:
    """Open and check a checkpoint directory or a GGUF file; raise UserError/InputFileError (exit 2) on bad input.

    ``src`` may be written ``pkg:PACKAGE/PATH`` (:func:`~orbitctl.arch.model_source.resolve_model_path`)."""
    from orbitctl.arch.model_source import is_gguf, resolve_model_path

    path = resolve_model_path(src)
    if is_gguf(path):
        from orbitctl.codec.gguf_source import open_gguf

        return open_gguf(path)
    if not path.is_dir():
        raise InputFileError(f"{path}: checkpoint directory not found", fix="pass a Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file")
    config = _read_config(path)
    files = _shard_files(path)
    entries: dict[str, TensorEntry] = {}
    headers: dict[str, bytes] = {}
    for file in files:
        _, file_entries, raw = read_header(file)
        headers[file.name] = raw
        for e in sorted(file_entries, key=lambda e: e.begin):
            entries[e.name] = e
    _check_index(path, entries)
    ckpt = Checkpoint(path, config, entries, files, headers)
    _check_dtypes(ckpt)
    return ckpt


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    config = read_json(file, what="config.json", fix="a Hugging Face checkpoint directory needs a valid config.json "
                                                      "(repair or re-download it)")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{file}: model_type '{model_type}' is not supported by orbitctl quantize",
                        fix=f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def _shard_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.exists():
        weight_map = read_json(index, what="safetensors index", fix="repair or re-download the index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputFileError(f"{index}: not a safetensors index (no weight_map)", fix="repair or re-download the index")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (path / name).exists():
                raise InputFileError(f"{index}: names shard '{name}', which is missing from {path}",
                                     fix="copy the missing shard into the checkpoint directory")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if not others:
        raise InputFileError(f"{path}: no *.safetensors files", fix="orbitctl quantize reads safetensors checkpoints (convert .bin with transformers first)")
    if len(others) > 1:
        raise InputFileError(f"{path}: {len(others)} safetensors files but no {INDEX_NAME}", fix="add the index written by save_pretrained")
    return others


def _check_index(path: Path, entries: dict[str, TensorEntry]) -> None:
    index = path / INDEX_NAME
    if not index.exists():
        return
    weight_map = read_json(index, what="safetensors index")["weight_map"]
    for name, file in weight_map.items():
        entry = entries.get(name)
        if entry is None or entry.file.name != file:
            raise InputFileError(f"{index}: tensor '{name}' is not in shard '{file}'", fix="the index and the shards come from different checkpoints; copy them again")


def _check_dtypes(ckpt: Checkpoint) -> None:
    allowed_int = ckpt.source_quant == "int4"
    for name, e in ckpt.entries.items():
        if e.dtype in FLOAT_DTYPES:
            continue
        if e.dtype == "F8_E4M3" and (name + "_scale_inv") in ckpt.entries:
            continue
        if allowed_int and e.dtype in ("I32", "I64", "I8", "U8"):
            continue
        raise UserError(f"{e.file}: tensor '{name}' has dtype {e.dtype}, which orbitctl quantize cannot read",
                        fix="supported: F32, F16, BF16, F8_E4M3 with weight_scale_inv, compressed-tensors int4")
