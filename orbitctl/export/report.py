"""The per-tensor export report: each tensor, its GGUF type, exact or converted and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

EXACT = "exact"
CONVERTED = "converted"


@dataclass(frozen=True)
class TensorRecord:
    name: str
    """The tensor's name in the written file."""
    source: str
    """The base's (or adapter's) tensor it came from."""
    stored_as: str
    """What the source is stored as (``int4 g32``, ``nf4``, ``bf16``, ...)."""
    written_as: str
    """The type in the written file (``Q4_0``, ``F16``, ``F32``, ``BF16``)."""
    status: str
    """:data:`EXACT` (the file's values equal orbitctl's decoded ones) or :data:`CONVERTED`."""
    why: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}


def counts(records: list[TensorRecord]) -> dict:
    """Tensors by status and by written type."""
    return {"tensors": len(records), "exact": sum(r.status == EXACT for r in records),
            "converted": sum(r.status == CONVERTED for r in records),
            "by_type": dict(sorted(Counter(r.written_as for r in records).items()))}
