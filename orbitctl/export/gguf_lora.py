"""A PEFT LoRA adapter as a GGUF LoRA file for llama.cpp, unmerged.

The layout is llama.cpp's (``src/llama-adapter.cpp``, ``convert_lora_to_gguf.py``): ``general.type``
``adapter``, ``adapter.type`` ``lora``, ``adapter.lora.alpha``, and for every adapted weight
``<base tensor name>.lora_a`` and ``.lora_b``. The loader requires ``a.ne[0]`` = the base weight's
``ne[0]`` (its input width) and ``b.ne[1]`` = its output width, with ``a.ne[1] == b.ne[0]`` = rank,
and computes ``W x + (alpha / rank) * B (A x)``: so A is written as PEFT stores ``lora_A.weight``
([rank, in]) and B as ``lora_B.weight`` ([out, rank]), neither transposed. PEFT's scale is
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA, written as alpha = ``lora_alpha * sqrt(r)``).
For llama the rows of B for ``q_proj``/``k_proj`` take the base weight's row order. Values are
written as F32, which holds the bf16/fp32 adapter exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from orbitctl.errors import InputFileError, UserError
from orbitctl.export.archs import Arch, Namer
from orbitctl.export.report import EXACT, TensorRecord
from orbitctl.units import short_dtype

PEFT_PREFIX = "base_model.model."


@dataclass
class LoraPair:
    module: str
    """The adapted module's name in the model (``model.layers.0.self_attn.q_proj``)."""
    a: torch.Tensor
    """[rank, in], as PEFT stores it."""
    b: torch.Tensor
    """[out, rank]."""


@dataclass
class PeftLora:
    """A PEFT LoRA directory, read and checked."""

    path: Path
    rank: int
    alpha: float
    """The alpha llama.cpp needs for PEFT's scale: ``scale = alpha / rank``."""
    pairs: list[LoraPair]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def read_peft_lora(path: str | Path) -> PeftLora:
    """The adapter in ``path`` (adapter_config.json + adapter_model.safetensors); UserError where llama.cpp
    or a merge cannot carry it (DoRA, per-module alphas, experts' own adapters, bottleneck adapters)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise InputFileError(f"--adapter {path}: no such directory", fix="pass the adapter/ directory of a run (runs/NAME/adapter)")
    if (path / "bottleneck_config.json").exists():
        raise UserError(f"--adapter {path}: a bottleneck adapter is not a LoRA and cannot be exported or merged",
                        fix="export a run trained with adapter.kind: lora")
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    for file in (config_file, weights):
        if not file.exists():
            raise InputFileError(f"--adapter {path}: no {file.name}", fix="pass the adapter/ directory of a run (PEFT format)")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise UserError(f"{config_file}: a {'DoRA' if config.get('use_dora') else config.get('peft_type')} adapter is not a plain LoRA",
                        fix="llama.cpp loads plain LoRA adapters only")
    if (path / "expert_adapter.json").exists():
        raise UserError(f"--adapter {path}: LoRA on routed experts (adapter.experts) is not exported",
                        fix="export adapters trained with adapter.experts: none")
    if config.get("alpha_pattern"):
        raise UserError(f"{config_file}: alpha_pattern gives modules their own alpha; a GGUF LoRA has one",
                        fix="export adapters with one lora_alpha")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    effective = alpha * math.sqrt(rank) if config.get("use_rslora") else alpha
    tensors = load_file(str(weights))
    pairs = []
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b_key = key.replace(".lora_A.weight", ".lora_B.weight")
        if b_key not in tensors:
            raise InputFileError(f"{weights}: '{key}' has no lora_B", fix="save the adapter again")
        pairs.append(LoraPair(module, tensors[key], tensors[b_key]))
    if not pairs:
        raise InputFileError(f"{weights}: no lora_A/lora_B tensors", fix="pass the adapter/ directory of a LoRA run")
    if config.get("rank_pattern"):
        mixed = [p.module for p in pairs if p.a.shape[0] != rank]
        if mixed:
            raise UserError(f"{config_file}: rank_pattern gives {mixed[0]} rank {pairs[0].a.shape[0]}",
                            fix="export adapters with one rank")
    return PeftLora(path, rank, effective, pairs)


def write_lora_gguf(lora: PeftLora, arch: Arch, config: dict, path: Path, *, name: str,
                    base_shapes: dict[str, tuple[int, ...]]) -> list[TensorRecord]:
    """Write the adapter GGUF; ``base_shapes`` (hf name -> shape) checks every pair against its base weight."""
    import gguf

    namer = Namer(arch, config)
    writer = gguf.GGUFWriter(str(path), arch.gguf_arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
    writer.add_name(name)
    records = []
    for pair in lora.pairs:
        weight = pair.module + ".weight"
        target = namer.gguf_name(weight)
        shape = base_shapes.get(weight)
        if target is None or shape is None:
            raise UserError(f"{lora.path}: adapts '{pair.module}', which the base has no weight for",
                            fix="export the adapter with the base it was trained on")
        if (pair.b.shape[0], pair.a.shape[1]) != tuple(shape) or pair.a.shape[0] != pair.b.shape[1]:
            raise UserError(f"{lora.path}: '{pair.module}' has A {tuple(pair.a.shape)} and B {tuple(pair.b.shape)} for a "
                            f"{tuple(shape)} weight", fix="export the adapter with the base it was trained on")
        rows = namer.row_order(weight, shape[0])
        b = pair.b if rows is None else pair.b[rows]
        for suffix, tensor, why in ((".lora_a", pair.a, "PEFT lora_A [rank, in], not transposed"),
                                    (".lora_b", b, "PEFT lora_B [out, rank]" + (", rows in llama.cpp's q/k order" if rows is not None else ""))):
            writer.add_tensor(target + suffix, np.ascontiguousarray(tensor.to(torch.float32).numpy()))
            records.append(TensorRecord(target + suffix, pair.module, short_dtype(tensor.dtype), "F32",
                                        EXACT, why, tuple(tensor.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return records
