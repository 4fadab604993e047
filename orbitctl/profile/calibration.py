"""The calibration file: rates measured on one device, which ``orbitctl plan`` uses instead of published ones.

``orbitctl plan PROFILE --calibrate --out FILE`` (and ``benchmarks/device_check.py``) writes one; a profile names it
as ``hardware.calibration: FILE``. JSON::

    {"format": "orbitctl-calibration", "version": 1,
     "gpu": "h200",                       # the catalog entry it was measured on ("cpu" for a CPU)
     "device": "NVIDIA H200 ...",         # what the device calls itself
     "measured_at": "2026-12-06T05:00:00Z", "profile": "kimi-k2_grpo_int4_8xh200", "orbitctl": "0.1.0",
     "rates": {"gemm_flops_per_s": 6.1e14, ...},
     "shapes": {"gemm_flops_per_s": [16384, 7168, 2048], ...}}   # what each rate was measured at

The rates (docs/plan.md, "Calibration") are absolute; the planner divides a GPU's by the catalog's peaks. Read at
profile validation, so a missing or malformed file is refused before anything runs. Imports no torch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

FORMAT = "orbitctl-calibration"
VERSION = 1

CPU_KEYS = ("flops_per_s", "bytes_per_s", "op_s", "attention_block_s")
"""What a CPU calibration must hold: the rates ``plan --measure-time`` measures (plus, optionally,
``adapter_flops_per_s`` and ``kernel_flops_per_s``)."""
GPU_KEYS = ("gemm_flops_per_s", "hbm_bytes_per_s", "attention_bytes_per_s", "experts_decode_bytes_per_s",
            "experts_update_flops_per_s", "all_to_all_bytes_per_s")
"""What a GPU calibration may hold, absolute (FLOP/s or bytes/s); orbitctl.plan.rates.CALIBRATED says which factor
of the time model each replaces."""


def read_calibration(path: str | Path) -> dict[str, Any]:
    """The calibration file at ``path``, checked; ValueError naming what is wrong (the caller names the key)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not a calibration file ({err.__class__.__name__}: {err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a calibration file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ValueError(f"{path} is calibration format version {doc.get('version')!r}; this orbitctl reads {VERSION}")
    rates = doc.get("rates")
    if not isinstance(rates, dict) or not rates:
        raise ValueError(f"{path} has no rates")
    for key, value in rates.items():
        if key == "kernel_flops_per_s":
            ok = isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        if not ok:
            raise ValueError(f"{path}: rates.{key} is {value!r}, not a positive number")
    if doc.get("gpu") == "cpu":
        missing = [k for k in CPU_KEYS if k not in rates]
        if missing:
            raise ValueError(f"{path}: a CPU calibration lacks rates.{missing[0]}")
    elif not any(k in rates for k in GPU_KEYS):
        raise ValueError(f"{path} has none of the GPU rates {', '.join(GPU_KEYS)}")
    return doc


def write_calibration(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` (its ``rates`` and device facts) as a calibration file, whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, **doc}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
