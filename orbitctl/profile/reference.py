"""Render the profile schema as Markdown: the schema is the documentation (docs/profiles.md).

    python -m orbitctl.profile.reference > docs/profiles.md
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from orbitctl.profile.schema import Profile, describe_fields

HEADER = """# Profile reference

Every command reads the same YAML profile. Unknown keys are errors, every value is checked
against the bounds below, and every problem in a file is reported at once as
`FILE: key.path: message (got VALUE)` (exit code 2). Override any value on the command line
with `--set key.path=value` (repeatable). `orbitctl profile show PROFILE` prints the resolved
profile with every default and the derived values (world size, global batch, usable memory).

This page is generated from `orbitctl/profile/schema.py` by
`python -m orbitctl.profile.reference > docs/profiles.md`; a test keeps it in step.
"""


def markdown() -> str:
    describe_fields()
    lines = [HEADER]
    top = Profile.model_fields
    lines.append("## Top level\n")
    lines.append("| key | type | default | meaning |\n|---|---|---|---|")
    lines.append(_row("name", top["name"]))
    for name, field in top.items():
        model = _submodel(field.annotation)
        if model is None:
            continue
        lines.append(f"| `{name}` | section | | {field.description or ''} |")
    for name, field in top.items():
        model = _submodel(field.annotation)
        if model is not None:
            lines.extend(_section(name, model))
    return "\n".join(lines) + "\n"


def _section(prefix: str, model: type[BaseModel]) -> list[str]:
    out = [f"\n## `{prefix}`\n", "| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is not None:
            nested.append((f"{prefix}.{name}", sub))
            out.append(f"| `{prefix}.{name}` | section | | {field.description or ''} |")
        else:
            out.append(_row(f"{prefix}.{name}", field))
    for name, sub in nested:
        out.extend(_section(name, sub))
    return out


def _row(key: str, field: Any) -> str:
    default = field.default
    if default is PydanticUndefined:
        default = field.default_factory() if field.default_factory else "required"
    bounds = [f"{m.__class__.__name__.lower()} {getattr(m, m.__class__.__name__.lower(), '')}"
              for m in field.metadata if m.__class__.__name__ in ("Ge", "Gt", "Le", "Lt")]
    kind = _type_name(field.annotation) + (f" ({', '.join(bounds)})" if bounds else "")
    doc = (field.description or "").replace("|", "\\|")
    return f"| `{key}` | {kind} | `{default!r}` | {doc} |".replace("`None`", "unset")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    return getattr(annotation, "__name__", str(annotation))


def _submodel(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


if __name__ == "__main__":
    print(markdown(), end="")
