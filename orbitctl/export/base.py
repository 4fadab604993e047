"""The frozen base on disk, read one weight at a time, each as orbitctl stores and decodes it.

A weight comes back with what it is stored as: INT4 codes and bf16 group scales (``int4``), or
the dense matrix orbitctl's own dequantizer gives (nf4/fp4 through bitsandbytes, fp8 blocks),
or the plain tensor (norms, embeddings, ``lm_head``). ``decoded()`` is the float32 weight the
frozen base computes with (before the cast to the compute dtype), which is what an exported
file is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from orbitctl.codec.formats import dequantize_weight, unpack_int4
from orbitctl.codec.safetensors_io import TensorEntry, read_header, read_tensor
from orbitctl.errors import InputFileError
from orbitctl.rundir import read_json

INDEX_NAME = "model.safetensors.index.json"
_BNB_SIDECARS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.")
_INT4_SIDECARS = (".weight_scale", ".weight_shape")


@dataclass
class BaseWeight:
    """One tensor of the model as the base holds it."""

    name: str
    """The model's tensor name (``model.layers.0.self_attn.q_proj.weight``), whatever it is stored as."""
    stored_as: str
    """``int4``, ``nf4``, ``fp4``, ``fp8``, or the plain dtype (``bf16``, ``f16``, ``f32``)."""
    shape: tuple[int, ...]
    codes: torch.Tensor | None = None
    """INT4: int8 codes in [-8, 7], [out, in]."""
    scale: torch.Tensor | None = None
    """INT4: bf16 scales, [out, in / group]."""
    dense: torch.Tensor | None = None
    """Every other format: the tensor as stored (plain) or as orbitctl dequantizes it (float32)."""

    @property
    def group_size(self) -> int | None:
        return None if self.scale is None else self.shape[1] // self.scale.shape[1]

    def describe(self) -> str:
        return f"int4 g{self.group_size}" if self.stored_as == "int4" else self.stored_as

    def decoded(self) -> torch.Tensor:
        """The float32 weight orbitctl computes with: codes x scale for INT4 (exact in float32)."""
        if self.codes is not None:
            groups = self.scale.shape[1]
            w = self.codes.to(torch.float32).reshape(self.shape[0], groups, -1)
            return (w * self.scale.to(torch.float32).unsqueeze(-1)).reshape(self.shape)
        return self.dense.to(torch.float32)


class QuantizedBase:
    """A checkpoint written by ``orbitctl quantize`` (or a plain bf16 one), opened for reading."""

    def __init__(self, path: str | Path) -> None:
        from orbitctl.model.frozen_base import checkpoint_format

        self.path = Path(path)
        self.fmt = checkpoint_format(self.path)
        self.config = read_json(self.path / "config.json", what="config.json")
        self.entries = self._entries()

    def _entries(self) -> dict[str, TensorEntry]:
        index = self.path / INDEX_NAME
        if index.exists():
            files = sorted(set(read_json(index, what="safetensors index").get("weight_map", {}).values()))
        else:
            files = ["model.safetensors"] if (self.path / "model.safetensors").exists() else []
        if not files:
            raise InputFileError(f"{self.path}: no model.safetensors or {INDEX_NAME}",
                                 fix="run orbitctl quantize again, or point the profile at a complete base")
        entries: dict[str, TensorEntry] = {}
        for name in files:
            for entry in sorted(read_header(self.path / name)[1], key=lambda e: e.begin):
                entries[entry.name] = entry
        return entries

    def _is_sidecar(self, name: str) -> bool:
        if name.endswith(_INT4_SIDECARS) or name.endswith(".weight_scale_inv"):
            return True
        return any(part in name for part in _BNB_SIDECARS) and name.split(".weight.", 1)[0] + ".weight" in self.entries

    @property
    def tied(self) -> bool:
        """The output layer is the embedding (``tie_word_embeddings``): one matrix, ``embed_tokens``."""
        from orbitctl.arch import tied_embeddings

        return tied_embeddings(self.config)

    def names(self) -> list[str]:
        """The model's tensor names in file order (``X.weight_packed`` stands for ``X.weight``). A tied model
        has no output weight of its own: an ``lm_head`` copy in the checkpoint is left out, as the loaders do."""
        return [n.removesuffix("_packed") for n in self.entries
                if not self._is_sidecar(n) and not (self.tied and n.startswith("lm_head."))]

    def read(self, name: str) -> BaseWeight:
        """The weight ``name`` (a model tensor name, as :meth:`names` gives it)."""
        base = name.removesuffix(".weight")
        if f"{base}.weight_packed" in self.entries:
            packed = read_tensor(self.entries[f"{base}.weight_packed"])
            scale = read_tensor(self.entries[f"{base}.weight_scale"])
            shape = tuple(int(v) for v in read_tensor(self.entries[f"{base}.weight_shape"]).tolist())
            codes = unpack_int4(packed, shape[1]).to(torch.int8)
            return BaseWeight(name, "int4", shape, codes=codes, scale=scale)
        entry = self.entries[name]
        sidecars = {n: read_tensor(e) for n, e in self.entries.items() if n.startswith(name + ".")}
        if f"{base}.weight_scale_inv" in self.entries:
            sidecars[f"{base}.weight_scale_inv"] = read_tensor(self.entries[f"{base}.weight_scale_inv"])
            dense = dequantize_weight(name, {name: read_tensor(entry), **sidecars}, "fp8", torch.float32)
            return BaseWeight(name, "fp8", tuple(dense.shape), dense=dense)
        if any(".quant_state.bitsandbytes__" in n for n in sidecars):
            fmt = "fp4" if any(n.endswith("bitsandbytes__fp4") for n in sidecars) else "nf4"
            dense = dequantize_weight(name, {name: read_tensor(entry), **sidecars}, fmt, torch.float32)
            return BaseWeight(name, fmt, tuple(dense.shape), dense=dense)
        tensor = read_tensor(entry)
        return BaseWeight(name, entry.dtype.lower(), tuple(tensor.shape), dense=tensor)

    def weights(self) -> Iterator[BaseWeight]:
        for name in self.names():
            yield self.read(name)
