"""A profile's architecture, parsed once per file version: what ``orbitctl plan`` and ``plan --measure`` plan.

Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=32)
def _builtin(name: str):
    from orbitctl.arch import builtin_arch

    return builtin_arch(name)


@lru_cache(maxsize=32)
def _from_file(path: str, mtime: float, key: str = "model.config"):
    from orbitctl.arch import arch_from_config, load_config_file

    return arch_from_config(load_config_file(path, key), name=Path(path).parent.name or "custom", source=path)


def profile_arch(profile):
    """The catalog's architecture, or model.config's (else model.path's config.json), parsed once per file version."""
    if profile.model.arch:
        return _builtin(profile.model.arch)
    from orbitctl.arch import model_config_file

    path, key = model_config_file(profile.model)
    return _from_file(str(path), path.stat().st_mtime if path.exists() else 0.0, key)
