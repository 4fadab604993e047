"""Profiles: the pydantic schema (no torch), the YAML loader with --set overrides, the GPU catalog."""

from orbitctl.profile.loader import dump_profile, load_profile
from orbitctl.profile.schema import Profile

__all__ = ["Profile", "dump_profile", "load_profile"]
