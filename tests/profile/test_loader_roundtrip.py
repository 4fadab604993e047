"""A profile written for a launched rank or a child process loads back to the same profile."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orbitctl.profile import dump_profile, load_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "profiles").glob("*.yaml")))
def test_shipped_profiles_round_trip(tmp_path, name):
    profile = load_profile(ROOT / "profiles" / name)
    again = tmp_path / name
    again.write_text(dump_profile(profile))
    assert load_profile(again).model_dump() == profile.model_dump()


def test_only_given_keys_are_written(tmp_path):
    """A key left at its default stays unset, so rules that ask whether it was given agree on both sides."""
    tiny = ROOT / "profiles" / "tiny-moe-cpu.yaml"
    profile = load_profile(tiny, ["quant.compute_dtype=fp32"])
    written = yaml.safe_load(dump_profile(profile))
    assert written["quant"]["compute_dtype"] == "fp32" and "dtype" not in written["model"]
    path = tmp_path / "p.yaml"
    path.write_text(dump_profile(profile))
    assert "dtype" not in load_profile(path).model.model_fields_set
