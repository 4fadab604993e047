"""A GGUF file (llama.cpp's format) opened as a checkpoint source for `orbitctl quantize`.

    from orbitctl.codec.source import open_checkpoint
    ckpt = open_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")   # a GGUFCheckpoint
    ckpt.config["num_hidden_layers"], ckpt.read("model.layers.0.self_attn.q_proj.weight")

It presents the interface of :class:`~orbitctl.codec.source.Checkpoint`: a Hugging Face config
built from the GGUF metadata, entries under Hugging Face tensor names in Hugging Face shapes
([out, in]), and ``read(name)``, which decodes one tensor with ``gguf.quants.dequantize`` (every
block type gguf's reader decodes: Q4_0 ... Q8_0, the K-quants, the IQ types, F16, BF16, F32).
llama.cpp's converter permutes the rows of q_proj and k_proj for its rope layout; ``read``
undoes it, so the tensors equal the Hugging Face checkpoint the file was made from.

A Q4_0 matrix is symmetric 4-bit with one fp16 scale per 32 input columns: exactly our int4
format at group size 32, so :meth:`GGUFCheckpoint.stored_as` hands it over as codes and fp16
scales without decoding it (the mirror of ``orbitctl export``'s Q4_0 writer). Everything else
is decoded to float32 and requantized by the converter.

Everything is checked at open (magic, header, tensor table against the file size,
architecture, block types, the tensor names expected of a llama), so bad input fails in the
first second with one line. The tensor data is memory-mapped by gguf's reader and copied out
one tensor at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from orbitctl.arch.model_source import gguf_config, open_gguf_reader
from orbitctl.codec.checkpoint import Checkpoint
from orbitctl.errors import InputFileError, UserError

# GGUF block name -> Hugging Face module name, inside model.layers.N
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors llama.cpp writes that a Hugging Face llama has no parameter for (recomputed from the config)
_IGNORED = ("rope_freqs", "rope_factors_long", "rope_factors_short")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
FLOAT_TYPES = ("F32", "F16", "BF16")
Q4_0_BLOCK = 32


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a name llama has not."""
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        module = _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{module}.{kind}" if module else None
    base, _, kind = gguf_name.rpartition(".")
    module = _TOP_NAMES.get(base)
    return f"{module}.{kind}" if module and kind in ("weight", "bias") else None


@dataclass(frozen=True)
class GGUFEntry:
    """One GGUF tensor under its Hugging Face name: stored type, Hugging Face shape, bytes in the file."""

    name: str
    gguf_name: str
    dtype: str
    """F32, F16 or BF16 for a plain tensor, else the GGML block type (Q4_0, Q4_1, Q8_0, Q4_K, ...)."""
    shape: tuple[int, ...]
    nbytes: int
    index: int
    """Position in the reader's tensor list."""
    file: Path
    rope_heads: int | None = None
    """Heads of llama.cpp's q/k row permutation to undo (None: not permuted)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class GGUFCheckpoint(Checkpoint):
    """A checked GGUF file; ``path`` is the file, ``files`` is [path]."""

    reader: object = field(default=None, repr=False)
    source_format = "gguf"

    @property
    def source_quant(self) -> str:
        return "none"  # decoded per tensor (or copied exactly, see stored_as): never a pass-through

    @property
    def side_dir(self) -> None:
        return None  # no directory of tokenizer files: the tokenizer is in the metadata

    def weight_names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str, handle=None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor in Hugging Face layout: plain tensors in their own dtype, block-quantized ones decoded to float32."""
        import numpy as np
        from gguf.quants import dequantize

        entry = self.entries[name]
        tensor = self.reader.tensors[entry.index]
        if entry.dtype == "BF16":
            array = np.asarray(tensor.data).view(np.uint16).astype(np.int32) << 16
            out = torch.from_numpy(array.view(np.float32)).to(torch.bfloat16)
        elif entry.dtype in ("F32", "F16"):
            out = torch.from_numpy(np.array(tensor.data, copy=True))
        else:
            out = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)))
        out = out.reshape(entry.shape)
        if entry.rope_heads:
            out = unpermute_rope_rows(out, entry.rope_heads)
        return out.contiguous()

    def stored_as(self, name: str, spec) -> dict[str, torch.Tensor] | None:
        """The int4 tensors of a Q4_0 weight copied exactly when ``spec`` is int4 at group size 32, else None.

        Q4_0 stores per block of 32 an fp16 scale d and 4-bit q (value = d * (q - 8)); our int4 stores
        codes q - 8 in [-8, 7] and one scale per group: the codes are packed as they are and the scales
        kept in fp16 (bf16 cannot hold every fp16 value)."""
        import numpy as np

        from orbitctl.codec.formats import pack_int4

        entry = self.entries[name]
        if not self.lossless(name, spec):
            return None
        blocks = np.asarray(self.reader.tensors[entry.index].data).reshape(-1, 2 + Q4_0_BLOCK // 2)
        scale = blocks[:, :2].copy().view(np.float16).reshape(entry.shape[0], -1)
        qs = blocks[:, 2:]
        # llama.cpp's Q4_0 nibble order: the low nibbles are elements 0..15 of the block, the high ones 16..31
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - 8
        codes_t = torch.from_numpy(codes.reshape(entry.shape))
        scale_t = torch.from_numpy(scale)
        if entry.rope_heads:
            codes_t = unpermute_rope_rows(codes_t, entry.rope_heads)
            scale_t = unpermute_rope_rows(scale_t, entry.rope_heads)
        base = name[: -len(".weight")]
        return {f"{base}.weight_packed": pack_int4(codes_t.contiguous()), f"{base}.weight_scale": scale_t.contiguous(),
                f"{base}.weight_shape": torch.tensor(list(entry.shape), dtype=torch.int64)}

    def lossless(self, name: str, spec) -> bool:
        """True when ``name`` is Q4_0 and the target is int4 at group size 32: its codes and scales are copied."""
        entry = self.entries[name]
        return entry.dtype == "Q4_0" and spec.fmt == "int4" and spec.group_size == Q4_0_BLOCK and len(entry.shape) == 2

    def fingerprint(self) -> str:
        """sha256 of the config, the file's name and size and the tensor table (cheap, no data read)."""
        h = hashlib.sha256()
        h.update(json.dumps(self.config, sort_keys=True).encode())
        h.update(f"{self.path.name}:{self.path.stat().st_size}".encode())
        for e in self.entries.values():
            h.update(f"{e.gguf_name}:{e.dtype}:{e.shape}:{e.nbytes}".encode())
        return h.hexdigest()


def unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: its converter interleaves each head's two rotary halves
    (rows viewed as (2, d/2) written as (d/2, 2)); here they are viewed as (d/2, 2) and put back."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and check a GGUF file; raise UserError/InputFileError (exit 2) on bad input."""
    from gguf.quants import _type_traits

    path = Path(path)
    reader = open_gguf_reader(path, key=None)
    config = gguf_config(path, key=None, reader=reader)
    decodable = set(FLOAT_TYPES) | {t.name for t in _type_traits}
    entries: dict[str, GGUFEntry] = {}
    for index, t in enumerate(reader.tensors):
        name = hf_tensor_name(t.name)
        if name is None:
            if t.name.split(".")[0] in _IGNORED:
                continue
            raise UserError(f"{path}: tensor '{t.name}' has no place in a llama model",
                            fix="orbitctl reads llama GGUF files as llama.cpp's converter writes them")
        kind = t.tensor_type.name
        if kind not in decodable:
            raise UserError(f"{path}: tensor '{t.name}' is {kind}, which gguf's reader cannot decode",
                            fix=f"re-quantize the file to one of {', '.join(sorted(decodable))}")
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))  # GGUF lists the fastest dimension first
        entries[name] = GGUFEntry(name, t.name, kind, shape, int(t.n_bytes), index, path, _rope_heads(name, config))
    _check_llama_tensors(path, config, entries)
    return GGUFCheckpoint(path, config, entries, [path], reader=reader)


def _rope_heads(name: str, config: dict) -> int | None:
    if name.endswith("self_attn.q_proj.weight"):
        return config["num_attention_heads"]
    if name.endswith("self_attn.k_proj.weight"):
        return config["num_key_value_heads"]
    return None


def _check_llama_tensors(path: Path, config: dict, entries: dict[str, GGUFEntry]) -> None:
    """Every weight a llama of this config needs, in the shape it needs: a mismatch is a damaged file."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    expected = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expected |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                     f"{p}.self_attn.q_proj.weight": (q_out, h), f"{p}.self_attn.k_proj.weight": (kv_out, h),
                     f"{p}.self_attn.v_proj.weight": (kv_out, h), f"{p}.self_attn.o_proj.weight": (h, q_out),
                     f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                     f"{p}.mlp.down_proj.weight": (h, inter)}
    for name, shape in expected.items():
        entry = entries.get(name)
        if entry is None:
            raise InputFileError(f"{path}: no tensor for {name} (GGUF {_gguf_name(name)})",
                                 fix="the file is incomplete or not a llama model")
        if entry.shape != shape:
            raise InputFileError(f"{path}: tensor {entry.gguf_name} has shape {list(entry.shape)}, the metadata implies {list(shape)}",
                                 fix="the file's metadata and tensors disagree; re-convert it")


def _gguf_name(hf_name: str) -> str:
    for gguf, hf in _TOP_NAMES.items():
        if hf_name.startswith(hf + "."):
            return gguf + hf_name[len(hf):]
    match = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
    if match:
        for gguf, hf in _BLOCK_NAMES.items():
            if hf == match.group(2):
                return f"blk.{match.group(1)}.{gguf}.{match.group(3)}"
    return hf_name
