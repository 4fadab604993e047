"""docs/profiles.md is generated from the schema and must match it."""

from pathlib import Path

from orbitctl.profile.reference import markdown
from orbitctl.profile.schema import Profile

DOC = Path(__file__).resolve().parents[2] / "docs" / "profiles.md"


def test_reference_lists_every_field_with_its_docstring():
    text = markdown()
    for section, field in Profile.model_fields.items():
        assert field.description, f"{section} has no docstring"
        model = field.annotation
        if hasattr(model, "model_fields"):
            for name, sub in model.model_fields.items():
                assert sub.description, f"{section}.{name} has no docstring"
                assert f"`{section}.{name}`" in text


def test_docs_page_is_up_to_date():
    assert DOC.read_text() == markdown(), "regenerate: python -m orbitctl.profile.reference > docs/profiles.md"
