"""A checkpoint opened for streaming, whichever file it came from: config, every tensor's location, its quantization.

:func:`~orbitctl.codec.source.open_checkpoint` opens a Hugging Face directory as a :class:`Checkpoint`; a GGUF file
opens as its subclass :class:`~orbitctl.codec.gguf_source.GGUFCheckpoint`, with the same interface. Both sources
import this module; it imports neither.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orbitctl.codec.formats import FP8_BLOCK, dequantize_fp8_blocks
from orbitctl.codec.safetensors_io import TensorEntry, read_tensor


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
