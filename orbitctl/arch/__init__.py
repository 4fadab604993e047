"""Hugging Face config.json -> ArchSpec: every weight matrix's shape and kind, parameter counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from orbitctl.arch.catalog import builtin_config, builtin_names, resolve_name
from orbitctl.arch.parse import SUPPORTED, arch_from_config
from orbitctl.arch.spec import ArchSpec, Layer, Weight
from orbitctl.errors import InputFileError, UserError

if TYPE_CHECKING:
    from orbitctl.profile.schema import Profile

__all__ = ["ArchSpec", "Layer", "Weight", "SUPPORTED", "arch_from_config", "builtin_arch", "load_arch",
           "load_config_file", "builtin_names"]


def builtin_arch(name: str) -> ArchSpec:
    """The ArchSpec of a catalog entry ('kimi-k2', 'llama-3.1-8b', ...)."""
    key = resolve_name(name)
    if key is None:
        raise UserError(f"model.arch: unknown architecture '{name}'", fix=f"known: {', '.join(builtin_names())}")
    return arch_from_config(builtin_config(key), name=key, source=f"arch '{key}'")


def load_config_file(path: str | Path) -> dict:
    file = Path(path)
    if not file.is_file():
        raise InputFileError(f"model.config: {path}: file not found", fix="point model.config at a config.json")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputFileError(f"model.config: {path}: not valid JSON ({exc})", fix="use the model's config.json") from exc
    if not isinstance(data, dict):
        raise InputFileError(f"model.config: {path}: top level must be a JSON object")
    return data


def load_arch(profile: "Profile") -> ArchSpec:
    """The architecture a profile names: model.arch from the catalog, or model.config from a file."""
    if profile.model.arch:
        return builtin_arch(profile.model.arch)
    path = profile.model.config
    return arch_from_config(load_config_file(path), name=Path(path).parent.name or "custom", source=str(path))
