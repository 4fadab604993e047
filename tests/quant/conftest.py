"""Tiny checkpoints for the quantizer tests, built once per session, and an independent reference.

The reference (:func:`dequantized_reference`) reads a quantized checkpoint with the
``safetensors`` library and decodes every weight with the format's own tools (bitsandbytes'
``dequantize_4bit``, the compressed-tensors decompressor, the FP8 block formula), then writes a
plain bf16 checkpoint that transformers loads: the "dequantize, then bf16" model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

ARCHS = ("llama", "qwen3_moe", "deepseek_v3")
SHARD = "40KB"  # every tiny source spans several shards


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from orbitctl.model.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, root / arch, max_shard_size=SHARD) for arch in ARCHS}


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, tiny_models):
    """quantized(arch, fmt, **kw) -> output dir, converted once per distinct arguments."""
    from orbitctl.quant.convert import quantize_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    cache: dict[tuple, Path] = {}

    def make(arch: str, fmt: str, **kw) -> Path:
        key = (arch, fmt, tuple(sorted(kw.items())))
        if key not in cache:
            out = root / f"{arch}-{fmt}-{len(cache)}"
            kw.setdefault("max_shard_bytes", 60_000)
            kw.setdefault("group_size", 32 if fmt == "int4" else 64)
            quantize_checkpoint(tiny_models[arch], out, fmt=fmt, **kw)
            cache[key] = out
        return cache[key]

    return make


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with the safetensors library."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    return tensors


def logits_of(model, seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm())


def decode_ct_int4(tensors: dict[str, torch.Tensor], prefix: str, qc: dict) -> torch.Tensor:
    """Decode one pack-quantized weight with the compressed-tensors package's own decompressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = next(iter(qc["config_groups"].values()))
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".weight_")}
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


def dequantized_reference(quant_dir: Path, out_dir: Path) -> Path:
    """Write the bf16 checkpoint a quantized checkpoint stands for, decoded with third-party code."""
    import bitsandbytes.functional as bnbf
    from safetensors.torch import save_file

    config = json.loads((quant_dir / "config.json").read_text())
    qc = config.pop("quantization_config", None) or {}
    method = qc.get("quant_method")
    tensors = read_all(quant_dir)
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if method == "bitsandbytes" and name + ".quant_map" in tensors:
            sidecars = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
            state = bnbf.QuantState.from_dict(sidecars, device=torch.device("cpu"))
            dense[name] = bnbf.dequantize_4bit(t, state).to(torch.bfloat16)
        elif method == "compressed-tensors" and name.endswith(".weight_packed"):
            prefix = name[: -len(".weight_packed")]
            dense[prefix + ".weight"] = decode_ct_int4(tensors, prefix, qc).to(torch.bfloat16)
        elif method == "fp8" and name + "_scale_inv" in tensors:
            s = tensors[name + "_scale_inv"]
            full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
            dense[name] = (t.float() * full).to(torch.bfloat16)
        elif ".weight." in name or name.endswith(("_scale_inv", ".weight_scale", ".weight_shape")):
            continue
        else:
            dense[name] = t
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(dense, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


@pytest.fixture(scope="session")
def qt():
    """The helpers above, for test modules (conftest is not importable under --import-mode=importlib)."""
    from types import SimpleNamespace

    return SimpleNamespace(read_all=read_all, logits_of=logits_of, rel_err=rel_err, decode_ct_int4=decode_ct_int4,
                           dequantized_reference=dequantized_reference)
