"""Hugging Face config.json -> ArchSpec: every weight matrix's shape and kind, parameter counts."""

from __future__ import annotations

from pathlib import Path

from orbitctl.arch.catalog import builtin_config, builtin_names, resolve_name
from orbitctl.arch.parse import SUPPORTED, arch_from_config, tied_embeddings
from orbitctl.arch.spec import ArchSpec, Layer, Weight
from orbitctl.errors import UserError

__all__ = ["ArchSpec", "Layer", "Weight", "SUPPORTED", "arch_from_config", "builtin_arch",
           "load_config_file", "builtin_names", "model_config_file", "model_arch", "tied_embeddings"]


def builtin_arch(name: str) -> ArchSpec:
    """The ArchSpec of a catalog entry ('kimi-k2', 'llama-3.1-8b', ...)."""
    key = resolve_name(name)
    if key is None:
        raise UserError(f"model.arch: unknown architecture '{name}'", fix=f"known: {', '.join(builtin_names())}")
    return arch_from_config(builtin_config(key), name=key, source=f"arch '{key}'")


def load_config_file(path: str | Path, key: str = "model.config") -> dict:
    """A model's config.json as a dict; a missing or malformed file names ``key`` and the fix.
    (orbitctl.rundir is imported here: a plan of a built-in architecture never reads a file through it.)"""
    from orbitctl.arch.model_source import gguf_config, is_gguf
    from orbitctl.rundir import read_json

    if is_gguf(Path(path)):  # model.path naming a GGUF file: the config its metadata describes
        return gguf_config(path, key)
    fix = "point model.config at the model's config.json" if key == "model.config" else \
        "point model.path at a Hugging Face checkpoint directory, or set model.config"
    return read_json(path, what="config.json", key=key, fix=fix)


def model_config_file(model) -> tuple[Path, str]:
    """The config.json a profile's ``model`` section takes its architecture from, and the key that names it:
    ``model.config``, else the config.json inside the ``model.path`` directory. Every reader of a profile's
    architecture file goes through here. A ``model.path`` without one is a UserError naming ``model.path``."""
    if model.config:
        return Path(model.config), "model.config"
    if not model.path:
        raise UserError("model: no architecture to read", fix="set model.arch, model.config or model.path")
    from orbitctl.arch.model_source import is_gguf, resolve_model_path

    source = resolve_model_path(model.path)  # pkg:PACKAGE/PATH too
    if is_gguf(source):
        return source, "model.path"
    config = source / "config.json"
    if not config.is_file():
        raise UserError(f"model.path: {model.path} has no config.json",
                        fix="point model.path at a Hugging Face checkpoint directory, or set model.config")
    return config, "model.path"


def model_arch(model) -> ArchSpec:
    """The ArchSpec of a profile's ``model`` section: the catalog entry (``model.arch``), else the architecture
    file :func:`model_config_file` finds."""
    if model.arch:
        return builtin_arch(model.arch)
    path, key = model_config_file(model)
    return arch_from_config(load_config_file(path, key), name=path.parent.name or "custom", source=str(path))
