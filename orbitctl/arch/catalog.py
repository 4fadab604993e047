"""The built-in architecture catalog: real config.json files shipped in ``arch/configs/``.

``arch: kimi-k2`` in a profile names ``configs/kimi-k2.json``. Reading the catalog imports
nothing heavy.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


@lru_cache(maxsize=1)
def builtin_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_name(name: str) -> str | None:
    """Catalog key for a user-written name ('Kimi-K2', 'kimi_k2' -> 'kimi-k2'), or None."""
    key = name.strip().lower().replace("_", "-")
    return key if key in builtin_names() else None


def builtin_config(name: str) -> dict:
    key = resolve_name(name)
    if key is None:
        raise KeyError(name)
    return json.loads((CONFIG_DIR / f"{key}.json").read_text())
