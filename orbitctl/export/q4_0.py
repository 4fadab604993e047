"""INT4 group-wise codes and scales as llama.cpp's Q4_0 blocks, carrying the same integers.

Q4_0 (ggml's ``block_q4_0``, gguf-py's ``gguf.quants.Q4_0``): 32 weights per block, 18 bytes:
one fp16 scale ``d`` (little endian), then 16 bytes whose low nibbles hold elements 0..15 and
high nibbles elements 16..31, each stored as ``q`` in 0..15 with ``w = d * (q - 8)``. orbitctl's
INT4 is symmetric with codes in [-8, 7] and one bf16 scale per group of 32, 64 or 128 input
columns, so ``q = code + 8`` and every block of a group takes the group's scale: the integers are
copied, nothing is re-rounded. Only the scale changes dtype; a bf16 scale that fp16 does not hold
exactly (below fp16's normal range, about 6.1e-5, where fp16 has fewer mantissa bits) is rounded
to the nearest fp16 and reported; one above fp16's range (65504) cannot be a Q4_0 scale at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = 2 + BLOCK // 2


@dataclass(frozen=True)
class ScaleCheck:
    """How the group scales of one weight come through fp16."""

    total: int
    inexact: int
    """Scales fp16 rounds (their Q4_0 weights differ from orbitctl's by that rounding)."""
    overflow: int
    """Scales beyond fp16's range (the weight cannot be written as Q4_0)."""
    max_rel_change: float

    @property
    def exact(self) -> bool:
        return self.inexact == 0 and self.overflow == 0


def check_layout() -> None:
    """Fail loudly if the installed gguf package's Q4_0 is not the block this module writes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0] != (BLOCK, BLOCK_BYTES):
        raise RuntimeError(f"gguf's Q4_0 is {GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]}, expected {(BLOCK, BLOCK_BYTES)}")


def fp16_scales(scale: torch.Tensor) -> tuple[torch.Tensor, ScaleCheck]:
    """The scales as fp16 (round to nearest) and what that did to them."""
    wide = scale.to(torch.float32)
    half = wide.to(torch.float16)
    back = half.to(torch.float32)
    overflow = int((torch.isinf(back) & torch.isfinite(wide)).sum())
    inexact = int(((back != wide) & torch.isfinite(back)).sum())
    finite = torch.isfinite(back) & (wide != 0)
    rel = ((back - wide).abs() / wide.abs())[finite]
    return half, ScaleCheck(int(wide.numel()), inexact, overflow, float(rel.max()) if rel.numel() else 0.0)


def can_pack(shape: tuple[int, ...], group_size: int | None) -> str | None:
    """Why a weight of this shape and INT4 group cannot be Q4_0 blocks, or None."""
    if len(shape) != 2:
        return "not a 2-D weight"
    if group_size is None or group_size % BLOCK:
        return f"INT4 group {group_size} is not a multiple of Q4_0's block of {BLOCK}"
    return None


def pack(codes: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, ScaleCheck]:
    """int8 codes [out, in] and bf16 scales [out, in/g] -> Q4_0 bytes [out, in/32*18] (uint8) and the scale check."""
    out_f, in_f = codes.shape
    blocks = in_f // BLOCK
    per_group = (in_f // scale.shape[1]) // BLOCK
    half, check = fp16_scales(scale)
    d = half.repeat_interleave(per_group, dim=1).contiguous().numpy().view(np.uint8).reshape(out_f, blocks, 2)
    q = (codes.to(torch.int16) + 8).to(torch.uint8).numpy().reshape(out_f, blocks, BLOCK)
    qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << np.uint8(4))
    if np.little_endian is False:  # fp16 bytes are little endian in GGUF
        d = d[..., ::-1]
    return np.ascontiguousarray(np.concatenate([d, qs], axis=-1).reshape(out_f, blocks * BLOCK_BYTES)), check


def unpack(data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """Q4_0 bytes back to float32 weights with gguf-py's own dequantizer (what llama.cpp computes with)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.ascontiguousarray(dequantize(np.asarray(data), GGMLQuantizationType.Q4_0))).reshape(shape)
