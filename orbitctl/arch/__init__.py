"""Hugging Face config.json -> ArchSpec: every weight matrix's shape and kind, parameter counts."""

from __future__ import annotations

from pathlib import Path

from orbitctl.arch.catalog import builtin_config, builtin_names, resolve_name
from orbitctl.arch.parse import SUPPORTED, arch_from_config
from orbitctl.arch.spec import ArchSpec, Layer, Weight
from orbitctl.errors import UserError

__all__ = ["ArchSpec", "Layer", "Weight", "SUPPORTED", "arch_from_config", "builtin_arch",
           "load_config_file", "builtin_names"]


def builtin_arch(name: str) -> ArchSpec:
    """The ArchSpec of a catalog entry ('kimi-k2', 'llama-3.1-8b', ...)."""
    key = resolve_name(name)
    if key is None:
        raise UserError(f"model.arch: unknown architecture '{name}'", fix=f"known: {', '.join(builtin_names())}")
    return arch_from_config(builtin_config(key), name=key, source=f"arch '{key}'")


def load_config_file(path: str | Path) -> dict:
    """A model's config.json as a dict; a missing or malformed file names model.config and the fix.
    (orbitctl.rundir is imported here: a plan of a built-in architecture never reads a file through it.)"""
    from orbitctl.rundir import read_json

    return read_json(path, what="config.json", key="model.config", fix="point model.config at the model's config.json")
