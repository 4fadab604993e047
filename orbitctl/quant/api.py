"""What `orbitctl quantize` calls: a profile-driven conversion, the explicit one, and --verify.

    from orbitctl.quant.api import quantize_profile
    result = quantize_profile("profiles/tiny-cpu.yaml")
"""

from __future__ import annotations

import re
from pathlib import Path

from orbitctl.errors import UserError
from orbitctl.quant.manifest import verify_output

__all__ = ["quantize_profile", "run_quantize", "verify_output", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, 1000 -> 1000."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"--max-shard-size: cannot read '{text}' as a size", fix="write it like 2GB, 500MB or 4GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def run_quantize(src: str, out: str, *, max_shard_size: str | int = "2GB", **kwargs):
    """quantize_checkpoint with a human-readable shard size."""
    from orbitctl.quant.convert import quantize_checkpoint

    return quantize_checkpoint(src, out, max_shard_bytes=parse_size(max_shard_size), **kwargs)


def quantize_profile(profile_path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, progress=None, eval_prompts: int = 0):
    """Quantize model.path into model.quantized_path with the profile's quant section."""
    from orbitctl.profile.loader import load_profile
    from orbitctl.quant.convert import quantize_checkpoint

    profile = load_profile(profile_path, overrides)
    q = profile.quant
    if not profile.model.path:
        raise UserError(f"{profile_path}: model.path is not set", fix="set model.path to the Hugging Face checkpoint directory to quantize "
                        "(a tiny catalog model such as the demo's is built and quantized by `orbitctl train`)")
    if not profile.model.quantized_path:
        raise UserError(f"{profile_path}: model.quantized_path is not set", fix="set model.quantized_path to the output directory")
    if q.format == "none":
        raise UserError(f"{profile_path}: quant.format is none, so there is nothing to quantize",
                        fix="the base is loaded from model.path as is; set quant.format to nf4, fp4, int4 or fp8 to quantize")
    compute = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[q.compute_dtype]
    return quantize_checkpoint(profile.model.path, profile.model.quantized_path, fmt=q.format, group_size=q.group_size,
                               double_quant=q.double_quant, storage_dtype=q.storage_dtype, modules=q.modules,
                               skip=tuple(q.skip), progress=progress, eval_prompts=eval_prompts, compute_dtype=compute)
