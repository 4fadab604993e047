"""What `orbitctl profile validate|show` calls.

    from orbitctl.profile import api
    api.validate_profiles(["profiles/tiny-cpu.yaml"])    # [{'path': ..., 'ok': True, 'problems': []}]
    api.resolved_profile("profiles/tiny-cpu.yaml")      # every value, defaults filled in, plus 'derived'
"""

from __future__ import annotations

from orbitctl.errors import ProfileError
from orbitctl.profile.loader import load_profile


def validate_profiles(paths: list[str], overrides: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """One row per file: ``{path, ok, problems}``, every file read."""
    rows = []
    for path in paths:
        try:
            load_profile(path, list(overrides))
            rows.append({"path": path, "ok": True, "problems": [], "rendered": None})
        except ProfileError as exc:
            rows.append({"path": path, "ok": False, "problems": exc.problems, "rendered": exc.render()})
    return rows


def failures(rows: list[dict]) -> ProfileError | None:
    """One ProfileError (exit 2) holding every failed file's problems, or None when all passed."""
    rendered = [row["rendered"] for row in rows if not row["ok"]]
    if not rendered:
        return None
    err = ProfileError("", [])
    err.message = "\n".join(rendered)
    return err


def resolved_profile(path: str, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The profile as every command sees it: defaults filled in, plus the values derived from it."""
    profile = load_profile(path, list(overrides))
    document = profile.model_dump(mode="json")
    document["derived"] = profile.derived()
    return document
