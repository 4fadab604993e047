"""Read and write safetensors files one tensor at a time.

The reader parses the header itself and copies each tensor with one ``readinto`` into a
fresh buffer, so a tensor costs exactly its own bytes: no memory map stays resident and the
converter's RSS does not grow with the shard size. The writer streams tensor data to disk as
it is produced behind a reserved header, so a shard of any size costs one tensor of memory.
The files are plain safetensors that ``safetensors.safe_open`` and transformers read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from orbitctl.errors import InputFileError
from orbitctl.rundir import atomic_file

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype name, shape and byte range inside the data section."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    data_start: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> tuple[dict, list[TensorEntry], bytes]:
    """Parse and check a safetensors header; raise InputFileError for a missing, bad or truncated file."""
    if not path.exists():
        raise InputFileError(f"{path}: file not found", fix="check the checkpoint directory and its index")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputFileError(f"{path}: truncated safetensors file ({size} bytes)", fix="copy or download the file again")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise InputFileError(f"{path}: truncated or not a safetensors file (header of {header_len} bytes, file of {size})",
                                 fix="copy or download the file again")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{path}: safetensors header is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})",
                             fix="copy or download the file again") from exc
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries = []
    for name, spec in header.items():
        dtype = spec.get("dtype")
        begin, end = spec.get("data_offsets", (0, -1))
        entries.append(TensorEntry(name, path, dtype, tuple(spec.get("shape", ())), begin, end, data_start))
        if data_start + end > size:
            raise InputFileError(f"{path}: truncated: tensor '{name}' ends at byte {data_start + end}, the file has {size}",
                                 fix="copy or download the file again")
    return metadata, entries, raw


def read_tensor(entry: TensorEntry, handle=None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Copy one tensor from disk into its own CPU buffer, or into ``scratch`` (uint8, large enough)
    when the caller is done with it before the next read (no fresh pages to fault in)."""
    dtype = DTYPES[entry.dtype]
    buf = scratch[:entry.nbytes] if scratch is not None else torch.empty(entry.nbytes, dtype=torch.uint8)
    own = handle is None
    f = entry.file.open("rb") if own else handle
    try:
        f.seek(entry.data_start + entry.begin)
        got = f.readinto(memoryview(buf.numpy()))
    finally:
        if own:
            f.close()
    if got != entry.nbytes:
        raise InputFileError(f"{entry.file}: truncated while reading '{entry.name}'", fix="copy or download the file again")
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return buf.view(dtype).reshape(entry.shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


class ShardWriter:
    """Write one safetensors shard tensor by tensor under a temporary name.

    Tensor data is appended right after a header area reserved up front (``reserve`` bytes);
    the header is filled in on :meth:`close` and padded with spaces, which JSON ignores.
    Tensors whose byte length would break the 8-byte alignment of what follows (odd-length
    metadata) are held back and written last, largest element size first, the same order
    the safetensors serializer uses.
    """

    def __init__(self, path: Path, reserve: int, metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.reserve = reserve + (-(8 + reserve)) % 8
        self.metadata = {"format": "pt", **(metadata or {})}
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self.held: list[tuple[str, torch.Tensor]] = []
        self.file = path.open("wb")
        self.file.write(b"\0" * (8 + self.reserve))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.entries or any(n == name for n, _ in self.held):
            raise ValueError(f"tensor '{name}' written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes % 8:
            self.held.append((name, tensor.detach().clone()))
            return
        self._write(name, tensor)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor_bytes(tensor)
        self.file.write(data)
        end = self.offset + len(data)
        self.entries[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [self.offset, end]}
        self.offset = end

    def close(self) -> None:
        for name, tensor in sorted(self.held, key=lambda nt: (-nt[1].element_size(), nt[0])):
            self._write(name, tensor)
        self.held = []
        header = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        if len(header) > self.reserve:
            self._rewrite_with_header(header)
            return
        header = header + b" " * (self.reserve - len(header))
        self.file.seek(0)
        self.file.write(struct.pack("<Q", len(header)) + header)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def _rewrite_with_header(self, header: bytes) -> None:
        # The estimate was short: copy the data behind a header of the right size.
        header = header + b" " * ((-(8 + len(header))) % 8)
        self.file.close()
        with atomic_file(self.path) as tmp, self.path.open("rb") as src, tmp.open("wb") as dst:
            dst.write(struct.pack("<Q", len(header)) + header)
            src.seek(8 + self.reserve)
            while chunk := src.read(64 * 1024 * 1024):
                dst.write(chunk)

    def abort(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def header_reserve(specs: list[tuple[str, str, tuple[int, ...]]]) -> int:
    """Bytes to reserve for a header naming these (name, dtype, shape) tensors, with slack for offsets."""
    body = {n: {"dtype": d, "shape": list(s), "data_offsets": [10**15, 10**15]} for n, d, s in specs}
    return len(json.dumps({"__metadata__": {"format": "pt"}, **body}, separators=(",", ":"))) + 32 * len(specs) + 1024
