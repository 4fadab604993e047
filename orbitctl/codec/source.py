"""A Hugging Face checkpoint directory opened for streaming: config, shards, tensors.

(A GGUF file opens as a :class:`~orbitctl.codec.gguf_source.GGUFCheckpoint` with the same interface.)

Everything is checked before any work starts, so bad input fails in the first second with
one line: a missing or truncated shard, an index naming a file that is not there, a tensor
dtype or architecture the converter does not handle. Tensors are then read one at a time;
FP8 block-quantized weights (DeepSeek-V3, Kimi-K2 base) come back dequantized.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orbitctl.errors import InputFileError, UserError
from orbitctl.codec.formats import FP8_BLOCK, dequantize_fp8_blocks
from orbitctl.codec.safetensors_io import TensorEntry, read_header, read_tensor
from orbitctl.rundir import read_json

INDEX_NAME = "model.safetensors.index.json"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")
FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass
class Checkpoint:
    """A checked checkpoint: its config, every tensor's location, and its quantization (if any)."""

    path: Path
    config: dict
    entries: dict[str, TensorEntry]
    files: list[Path]
    headers: dict[str, bytes] = field(default_factory=dict)
    source_format = "safetensors"
    """'safetensors' (a Hugging Face directory) or 'gguf'; a class constant, not a field."""

    @property
    def source_quant(self) -> str:
        """'none', 'fp8' (block-quantized e4m3) or 'int4' (compressed-tensors pack-quantized)."""
        qc = self.config.get("quantization_config") or {}
        method = qc.get("quant_method")
        if method == "fp8":
            return "fp8"
        if method == "compressed-tensors":
            return "int4"
        if method:
            return method
        return "none"

    def weight_names(self) -> list[str]:
        """Tensors in file order (each file read front to back), without quantization sidecars."""
        return [n for n in self.entries if not n.endswith("_scale_inv")]

    def read(self, name: str, handle=None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor as stored, except FP8 weights, which come back dequantized to bf16.

        With ``scratch`` the result may live in that buffer: valid until the buffer is reused.
        """
        entry = self.entries[name]
        tensor = read_tensor(entry, handle, scratch)
        scale_name = name + "_scale_inv"
        if entry.dtype == "F8_E4M3" and scale_name in self.entries:
            scale = read_tensor(self.entries[scale_name])
            out = torch.empty(tensor.shape, dtype=torch.bfloat16)
            # one row of blocks at a time: the float32 transient is 128 rows, not the whole matrix
            for r in range(0, tensor.shape[0], FP8_BLOCK):
                out[r:r + FP8_BLOCK] = dequantize_fp8_blocks(tensor[r:r + FP8_BLOCK], scale[r // FP8_BLOCK:r // FP8_BLOCK + 1])
            return out
        return tensor

    def stored_as(self, name: str, spec) -> dict[str, torch.Tensor] | None:
        """The tensors ``name`` is stored as in ``spec``, copied without decoding, or None (decode and quantize).
        A safetensors checkpoint has nothing of the kind; a GGUF file's Q4_0 weights do (int4, group 32)."""
        return None

    def lossless(self, name: str, spec) -> bool:
        """True when :meth:`stored_as` copies ``name`` exactly into ``spec``."""
        return False

    def source_type(self, name: str) -> str:
        """The tensor's type in the source (a safetensors dtype, or a GGUF block type such as Q4_1)."""
        return self.entries[name].dtype

    @property
    def side_dir(self) -> Path | None:
        """The directory whose tokenizer and generation files travel with the output (None: none)."""
        return self.path

    def fingerprint(self) -> str:
        """sha256 of config.json, the file list with sizes and every safetensors header (cheap, no data read)."""
        h = hashlib.sha256()
        h.update(json.dumps(self.config, sort_keys=True).encode())
        for f in self.files:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            h.update(self.headers.get(f.name, b""))
        return h.hexdigest()

    def source_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


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
