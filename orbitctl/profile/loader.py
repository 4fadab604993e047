"""Load a profile from YAML plus ``--set key.path=value`` overrides, reporting every error at once.

Every problem is one line ``FILE: key.path: message (got VALUE)``; the whole list is raised
as one :class:`ProfileError` (exit 2, no traceback).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from orbitctl.errors import ProfileError
from orbitctl.profile.schema import Profile


def load_profile(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Profile:
    """Read, override and validate a profile; raise ProfileError listing every problem."""
    data = read_profile_yaml(path)
    problems = apply_overrides(data, overrides)
    return validate_profile(data, str(path), problems)


def dump_profile(profile: Profile) -> str:
    """The profile as YAML that loads back to the same profile: the keys that were given, and no defaults,
    so the rules that ask whether a key was given (``model.dtype`` beside ``quant.compute_dtype``) see the
    same profile in a launched rank or a child process as in the command that wrote it."""
    return yaml.safe_dump(profile.model_dump(mode="json", exclude_unset=True), sort_keys=False)


def read_profile_yaml(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if not file.exists():
        raise ProfileError(str(path), ["file not found; check the path (shipped profiles are in profiles/)"])
    if file.is_dir():
        raise ProfileError(str(path), ["is a directory, not a profile YAML file"])
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(str(path), [f"cannot read: {exc}"]) from exc
    try:
        data = _safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ProfileError(str(path), [f"{where}YAML syntax error: {problem}"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProfileError(str(path), [f"top level must be a mapping of sections (got {type(data).__name__})"])
    return data


def _safe_load(text: str) -> Any:
    """``yaml.safe_load`` through libyaml's parser where PyYAML has it: the same constructor and resolver, so
    the same values, in a tenth of the time of a profile's pure-Python parse. A document it rejects is parsed
    again by the pure-Python loader, whose error (line, column, problem) the message quotes as before."""
    loader = getattr(yaml, "CSafeLoader", None)
    if loader is not None:
        try:
            return yaml.load(text, Loader=loader)
        except yaml.YAMLError:
            pass
    return yaml.safe_load(text)


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Apply ``key.path=value`` overrides in place; return problems found in them."""
    problems: list[str] = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item}: expected KEY.PATH=VALUE, e.g. memory.micro_batch_size=4")
            continue
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            problems.append(f"--set {item}: empty key")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        problem = _unknown_key_problem(parts)
        if problem:
            problems.append(f"--set {problem}")
            continue
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return problems


def validate_profile(data: dict[str, Any], source: str, problems: list[str] | None = None) -> Profile:
    problems = list(problems or [])
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        problems.extend(_merge_union_branches([_format_error(err, data) for err in exc.errors()]))
        raise ProfileError(source, _dedupe(problems)) from None
    if problems:
        raise ProfileError(source, _dedupe(problems))
    return profile


def _merge_union_branches(problems: list[str]) -> list[str]:
    """A value that fails every branch of a union (int or 'auto') reads as one line, not one per branch."""
    merged: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    for line in problems:
        key, _, rest = line.partition(": ")
        tail = ""
        if rest.endswith(")") and " (got " in rest:
            rest, _, tail = rest.rpartition(" (got ")
            tail = f" (got {tail}"
        merged.setdefault(key, []).append(rest)
        got.setdefault(key, tail)
    return [f"{k}: {' or '.join(dict.fromkeys(v))}{got[k]}" if len(v) > 1 else f"{k}: {v[0]}{got[k]}"
            for k, v in merged.items()]


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _format_error(err: dict[str, Any], data: dict[str, Any]) -> str:
    loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith("function-")]
    # pydantic puts union branch names into loc (e.g. 'int', "literal['auto']"); drop them
    loc = [p for p in loc if not (p in ("int", "constrained-int", "bool", "str", "float", "list[str]") or p.startswith(("literal[", "function")))]
    key = ".".join(loc)
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    msg = msg.replace("Input should be", "must be")
    if kind == "extra_forbidden":
        return _unknown_key_problem(loc) or f"{key}: unknown key"
    if kind == "missing":
        return f"{key}: required key is missing"
    # a cross-field message already names its keys
    if msg.split(":")[0].count(".") >= 1 and " " not in msg.split(":")[0]:
        return msg
    got = _lookup(data, loc)
    shown = f" (got {got!r})" if got is not _MISSING else ""
    return f"{key}: {msg}{shown}" if key else f"{msg}{shown}"


_MISSING = object()


def _lookup(data: Any, loc: list[str]) -> Any:
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _unknown_key_problem(parts: list[str]) -> str | None:
    """None when the dotted key exists in the schema, else a message with a did-you-mean."""
    model: type[BaseModel] | None = Profile
    for i, part in enumerate(parts):
        if model is None:
            return None
        fields = model.model_fields
        if part not in fields:
            path = ".".join(parts[: i + 1])
            close = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            hint = f"did you mean '{'.'.join(parts[:i] + [close[0]])}'?" if close else (
                f"valid keys here: {', '.join(fields)}")
            return f"{path}: unknown key; {hint}"
        annotation = fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return None
