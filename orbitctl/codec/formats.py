"""The storage formats of the frozen base, one weight matrix at a time.

- ``nf4``/``fp4``: bitsandbytes ``quantize_4bit`` (block size = group size, optional double
  quantization of the absmax, packed storage uint8 or bf16), serialized exactly as
  transformers serializes a bnb 4-bit ``Linear4bit``: ``W.weight`` plus ``W.weight.absmax``,
  ``.quant_map``, ``.nested_absmax``, ``.nested_quant_map`` and ``.quant_state.bitsandbytes__<type>``.
- ``int4``: symmetric group-wise INT4 in the compressed-tensors ``pack-quantized`` layout:
  ``W.weight_packed`` (int32, eight 4-bit values per word, lowest nibble first, stored as
  value + 8), ``W.weight_scale`` (bf16, one per group of input columns; fp16 when a GGUF Q4_0
  weight's own scales are copied, which bf16 cannot hold; any float dtype reads) and ``W.weight_shape``.
- ``fp8``: float8 e4m3 with one float32 scale per 128x128 block in ``W.weight_scale_inv``
  (the DeepSeek-V3 layout; dequantized weight = fp8 value x scale of its block).

The dequantizers use plain torch ops only, so they run on any device, under FakeTensorMode
and under torch.compile; the model's ``QuantLinear`` calls them on every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("nf4", "fp4", "int4", "fp8", "none")
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
INT4_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class FormatSpec:
    """How a weight matrix is stored: format and its knobs."""

    fmt: str
    group_size: int = 64
    double_quant: bool = True
    storage_dtype: str = "bf16"

    def describe(self) -> dict:
        if self.fmt in ("nf4", "fp4"):
            return {"format": self.fmt, "block_size": self.group_size, "double_quant": self.double_quant,
                    "storage_dtype": self.storage_dtype}
        if self.fmt == "int4":
            return {"format": "int4", "group_size": self.group_size, "symmetric": True}
        if self.fmt == "fp8":
            return {"format": "fp8", "fmt": "e4m3", "block": [FP8_BLOCK, FP8_BLOCK]}
        return {"format": self.fmt}


def unsupported_reason(shape: tuple[int, ...], spec: FormatSpec) -> str | None:
    """Why a weight of this shape cannot be stored in this format (it then stays bf16), or None."""
    if len(shape) != 2:
        return "not a 2-D weight"
    if spec.fmt == "int4" and shape[1] % spec.group_size:
        return f"in_features {shape[1]} is not a multiple of the INT4 group size {spec.group_size}"
    return None


# ----------------------------------------------------------------------------- INT4 (pack-quantized)

SCALE_BITS = 5
"""Significant bits an INT4 scale keeps. A code times its scale then has at most 3 + 5 = 8 significant bits
(``|code| <= 8`` has at most 3), which bf16 holds exactly: the dequantized weight is the same number in bf16 as in
float32, so a bf16 GEMM over it computes what the fused kernel computes (float32 accumulation of exact products)."""


def round_scales(scale: torch.Tensor) -> torch.Tensor:
    """float32 ``scale`` rounded to :data:`SCALE_BITS` significant bits (to nearest), as bf16."""
    mantissa, exponent = torch.frexp(scale.float())  # mantissa in [0.5, 1)
    steps = 2.0 ** SCALE_BITS
    return torch.ldexp(torch.round(mantissa * steps) / steps, exponent).to(torch.bfloat16)


def scales_exact_in_bf16(scale: torch.Tensor) -> bool:
    """Whether every INT4 weight of these scales is exactly a bf16 number: each scale has at most
    :data:`SCALE_BITS` significant bits (checkpoints written by :func:`quantize_int4`; not GGUF Q4_0's fp16 scales
    nor other tools' bf16 ones)."""
    mantissa, _ = torch.frexp(scale.float())
    scaled = mantissa * 2.0 ** SCALE_BITS
    return bool(torch.equal(scaled, torch.round(scaled)))


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise INT4: (int8 codes in [-8, 7], bf16 scales [out, in/group]).

    scale = absmax / 7.5 as compressed-tensors computes it, rounded to :data:`SCALE_BITS` significant bits
    (:func:`round_scales`: within 1/32 of it, so a group's largest weight is at most 7.75 steps, against 7.5
    unrounded); the codes are rounded against the stored scale, so dequantization reproduces exactly
    what was chosen.
    """
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group_size, group_size)
    absmax = w.abs().amax(dim=-1)
    scale = round_scales(absmax / 7.5)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-8, 7).to(torch.int8)
    return codes.reshape(out_f, in_f), scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] -> int32 words [out, in/8]; code j of a word sits at bits 4j..4j+3 as code + 8."""
    out_f, in_f = codes.shape
    nibbles = (codes.to(torch.int64) + 8).reshape(out_f, in_f // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (nibbles << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 words [..., in/8] -> int8-valued codes [..., in] (as int32), plain shifts and masks."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., :in_features] - 8


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, in_features: int, dtype=torch.bfloat16) -> torch.Tensor:
    codes = unpack_int4(packed, in_features)
    groups = scale.shape[-1]
    w = codes.to(torch.float32).reshape(*codes.shape[:-1], groups, in_features // groups)
    return (w * scale.to(torch.float32).unsqueeze(-1)).reshape(codes.shape).to(dtype)


def dequantize_int4_into(packed: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, values: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dequantize_int4` written into caller-owned buffers, bit for bit the same result, allocating nothing
    of the weight's size: ``codes`` int32 and ``values`` float32 scratch of the weight's shape [out, in] (in =
    8 x packed words), ``out`` the result in its dtype (None: ``values`` itself is the float32 result). Every
    step is an in-place op or an ``out=`` op of the same dtype, so no temporary is built on the way (a mixed-dtype
    op on the CPU would cast through a full-size temporary); the only allocation is the float32 copy of the
    scales (1/8 of the int32 codes)."""
    words = packed.shape[-1]
    groups = scale.shape[-1]
    in_features = codes.shape[-1]
    if in_features != 8 * words:
        raise ValueError(f"int4 workspace of {in_features} columns for {words} packed words")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    torch.bitwise_right_shift(packed.unsqueeze(-1), shifts, out=codes.view(*packed.shape, 8))
    codes.bitwise_and_(0xF).sub_(8)
    values.copy_(codes)
    values.view(*values.shape[:-1], groups, in_features // groups).mul_(scale.to(torch.float32).unsqueeze(-1))
    if out is None:
        return values
    return out.copy_(values)


# ----------------------------------------------------------------------------- FP8 (128x128 blocks)

def quantize_fp8_blocks(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight [out, in] and float32 block scales [ceil(out/128), ceil(in/128)]."""
    out_f, in_f = weight.shape
    rb, cb = -(-out_f // block), -(-in_f // block)
    w = torch.nn.functional.pad(weight.float(), (0, cb * block - in_f, 0, rb * block - out_f))
    blocks = w.reshape(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rb * block, cb * block)[:out_f, :in_f].contiguous(), scale


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.bfloat16, block: int = FP8_BLOCK) -> torch.Tensor:
    """Multiply every 128x128 block by its scale; partial edge blocks use the same scale."""
    out_f, in_f = weight.shape[-2:]
    s = scale_inv.to(torch.float32).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (weight.to(torch.float32) * s[..., :out_f, :in_f]).to(dtype)


# ----------------------------------------------------------------------------- bitsandbytes 4-bit

def _bnb_storage(spec: FormatSpec) -> torch.dtype:
    return torch.bfloat16 if spec.storage_dtype == "bf16" else torch.uint8


def quantize_bnb(name: str, weight: torch.Tensor, spec: FormatSpec) -> dict[str, torch.Tensor]:
    from orbitctl.codec.bnb4 import quantize_4bit

    packed, state = quantize_4bit(weight.to(torch.bfloat16), blocksize=spec.group_size, double_quant=spec.double_quant,
                                  quant_type=spec.fmt, quant_storage=_bnb_storage(spec))
    out = {name: packed}
    for key, value in state.as_dict(packed=True).items():
        out[f"{name}.{key}"] = value
    return out


def dequantize_bnb(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    packed = tensors[name]
    qs_dict = {k[len(name) + 1:]: v for k, v in tensors.items() if k != name}
    state = QuantState.from_dict(qs_dict, device=torch.device("cpu"))
    return bnbf.dequantize_4bit(packed, state)


# ----------------------------------------------------------------------------- per-format dispatch

def quantize_weight(name: str, weight: torch.Tensor, spec: FormatSpec) -> dict[str, torch.Tensor]:
    """Quantize ``name`` (a ``*.weight`` matrix) and return every tensor it is stored as, by full name."""
    base = name[: -len(".weight")]
    if spec.fmt in ("nf4", "fp4"):
        return quantize_bnb(name, weight, spec)
    if spec.fmt == "int4":
        codes, scale = quantize_int4(weight, spec.group_size)
        return {f"{base}.weight_packed": pack_int4(codes), f"{base}.weight_scale": scale,
                f"{base}.weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}
    if spec.fmt == "fp8":
        q, scale = quantize_fp8_blocks(weight)
        return {name: q, f"{base}.weight_scale_inv": scale}
    raise ValueError(f"unknown format {spec.fmt}")


def dequantize_weight(name: str, tensors: dict[str, torch.Tensor], fmt: str, dtype=torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_weight`: the dense matrix the stored tensors stand for."""
    base = name[: -len(".weight")]
    if fmt in ("nf4", "fp4"):
        return dequantize_bnb(name, tensors).to(dtype)
    if fmt == "int4":
        shape = tensors[f"{base}.weight_shape"].tolist()
        return dequantize_int4(tensors[f"{base}.weight_packed"], tensors[f"{base}.weight_scale"], shape[1], dtype)
    if fmt == "fp8":
        return dequantize_fp8_blocks(tensors[name], tensors[f"{base}.weight_scale_inv"], dtype)
    raise ValueError(f"unknown format {fmt}")


def stored_specs(name: str, shape: tuple[int, ...], spec: FormatSpec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor a weight becomes, to plan shards and reserve headers."""
    out_f, in_f = shape
    n = out_f * in_f
    base = name[: -len(".weight")]
    if spec.fmt in ("nf4", "fp4"):
        blocks = -(-n // spec.group_size)
        storage = "BF16" if spec.storage_dtype == "bf16" else "U8"
        packed_len = -(-n // 2) // (2 if storage == "BF16" else 1)
        specs = [(name, storage, (packed_len, 1)), (f"{name}.quant_map", "F32", (16,)),
                 (f"{name}.quant_state.bitsandbytes__{spec.fmt}", "U8", (256,))]
        if spec.double_quant:
            specs += [(f"{name}.absmax", "U8", (blocks,)), (f"{name}.nested_absmax", "F32", (-(-blocks // 256),)),
                      (f"{name}.nested_quant_map", "F32", (256,))]
        else:
            specs += [(f"{name}.absmax", "F32", (blocks,))]
        return specs
    if spec.fmt == "int4":
        return [(f"{base}.weight_packed", "I32", (out_f, in_f // 8)),
                (f"{base}.weight_scale", "BF16", (out_f, in_f // spec.group_size)), (f"{base}.weight_shape", "I64", (2,))]
    if spec.fmt == "fp8":
        return [(name, "F8_E4M3", shape), (f"{base}.weight_scale_inv", "F32", (-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)))]
    raise ValueError(f"unknown format {spec.fmt}")
