"""Units and names every layer shares: byte sizes and the dtype names profiles use.

    from orbitctl.units import GiB, gib, TORCH_DTYPE_NAMES
    f"{gib(plan.peak_bytes)} GiB"        # '151.10 GiB'
    TORCH_DTYPE_NAMES["bf16"]           # 'bfloat16'

Torch-free: the planner and the profile loader import it.
"""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

BYTE_UNITS = {"B": 1, "KIB": KiB, "MIB": MiB, "GIB": GiB, "TIB": TiB, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
              "TB": 1000**4}
"""Size suffixes (upper case) a user may write, binary and decimal."""

TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Profile dtype name -> torch dtype name (``getattr(torch, name)``)."""
SHORT_DTYPE_NAMES = {torch_name: short for short, torch_name in TORCH_DTYPE_NAMES.items()}
"""torch dtype name -> profile dtype name."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of each profile dtype."""


def gib(n: float, digits: int = 2) -> str:
    """Bytes as GiB with ``digits`` decimals, without the unit: ``gib(3 * GiB) == '3.00'``."""
    return f"{n / GiB:.{digits}f}"


def short_dtype(dtype) -> str:
    """'bf16' for torch.bfloat16 (or 'torch.bfloat16', or 'bfloat16'); unknown names pass through."""
    name = str(dtype).removeprefix("torch.")
    return SHORT_DTYPE_NAMES.get(name, name)
