"""The ``quantization_config`` written into config.json, one per format.

Each one is what the matching loader expects: transformers' bitsandbytes quantizer for
nf4/fp4, compressed-tensors (transformers, vLLM, SGLang) for int4, and the fine-grained FP8
quantizer (transformers, vLLM, SGLang read DeepSeek-V3 this way) for fp8. ``kept`` names the
linear modules left in bf16 so that the loaders do not expect quantized tensors there.
"""

from __future__ import annotations

from orbitctl.codec.formats import FP8_BLOCK, FormatSpec
from orbitctl.units import TORCH_DTYPE_NAMES, short_dtype


def quantization_config(spec: FormatSpec, kept: list[str], compute_dtype: str = "bfloat16") -> dict | None:
    if spec.fmt in ("nf4", "fp4"):
        return {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": spec.fmt,
            "bnb_4bit_use_double_quant": spec.double_quant,
            "bnb_4bit_compute_dtype": compute_dtype,
            "bnb_4bit_quant_storage": TORCH_DTYPE_NAMES.get(spec.storage_dtype, "uint8"),
            "llm_int8_skip_modules": sorted(kept),
            "llm_int8_threshold": 6.0,
            "llm_int8_has_fp16_weight": False,
            "llm_int8_enable_fp32_cpu_offload": False,
        }
    if spec.fmt == "int4":
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": spec.group_size, "dynamic": False, "actorder": None, "observer": "minmax",
                    },
                    "input_activations": None,
                    "output_activations": None,
                    "format": "pack-quantized",
                }
            },
            "ignore": sorted(kept),
            "kv_cache_scheme": None,
        }
    if spec.fmt == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": sorted(kept),
        }
    return None


def spec_from_quantization_config(qc: dict | None) -> FormatSpec:
    """Read back the format of a checkpoint orbitctl (or another tool) wrote."""
    if not qc:
        return FormatSpec("none")
    method = qc.get("quant_method")
    if method == "bitsandbytes":
        storage = qc.get("bnb_4bit_quant_storage", "uint8")
        return FormatSpec(qc.get("bnb_4bit_quant_type", "nf4"), 64, bool(qc.get("bnb_4bit_use_double_quant")),
                          "bf16" if short_dtype(storage) == "bf16" else "uint8")
    if method == "compressed-tensors":
        group = next(iter((qc.get("config_groups") or {}).values()), {}).get("weights", {}) or {}
        return FormatSpec("int4", int(group.get("group_size") or 32))
    if method == "fp8":
        return FormatSpec("fp8")
    raise ValueError(f"unsupported quant_method '{method}'")


def check_int4_config(qc: dict) -> str | None:
    """Why a compressed-tensors config is not symmetric group INT4 pack-quantized (None if it is)."""
    if qc.get("format") != "pack-quantized":
        return f"format '{qc.get('format')}' (expected pack-quantized)"
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits") != 4 or w.get("type", "int") != "int" or not w.get("symmetric", True) or w.get("strategy") != "group":
            return f"config group '{name}' is not symmetric 4-bit group-wise int"
    return None
