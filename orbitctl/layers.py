"""The layer order of the package: imports run down this list, never up and never sideways.

Each entry is one layer, lowest first; a module may import from its own package and from any
package in a lower layer. Packages that share a layer (``rl``, ``align`` and ``doctor``) are
siblings and do not import each other. ``tests/test_layers.py`` parses every module's imports
(those inside functions too) and fails on one that breaks the order; ``docs/architecture.md``
shows the same list, and the same test keeps the two equal.

Torch-free: the test and the docs read it without importing anything else.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "units", "procmem"),
    ("rundir", "isolated"),
    ("dist",),
    ("arch",),
    ("profile",),
    ("plan",),
    ("codec",),
    ("distances",),
    ("kernels",),
    ("model",),
    ("quant",),
    ("data",),
    ("builder",),
    ("rl", "align", "doctor", "report"),
    ("evals", "serve", "export"),
    ("launch",),
    ("cli",),
)
"""Lowest first. What each layer is for is in docs/architecture.md."""


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of a top-level part of ``orbitctl`` (a package or a module)."""
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    raise KeyError(f"orbitctl.{name} is in no layer of orbitctl.layers.LAYERS")


def render() -> str:
    """The layer list as docs/architecture.md shows it, highest first (``cli`` on top)."""
    return "\n".join("  " + "  |  ".join(names) for names in reversed(LAYERS))
