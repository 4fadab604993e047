"""What `orbitctl quantize` calls: a profile-driven conversion, the explicit one, and --verify.

    from orbitctl.quant import api
    result = api.quantize_profile("profiles/tiny-cpu.yaml")
    result = api.quantize("hf/llama-8b", "out/llama-8b-nf4", flags={"format": ("--format", "nf4")})
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, get_args

from orbitctl.errors import UserError
from orbitctl.quant.manifest import verify_output
from orbitctl.units import BYTE_UNITS, TORCH_DTYPE_NAMES

__all__ = ["quantize", "quantize_profile", "run_quantize", "src_out_options", "verify_output", "parse_size"]

_UNITS = {"": 1, **BYTE_UNITS}


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '512MiB' -> 536_870_912, 1000 -> 1000."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"--max-shard-size: cannot read '{text}' as a size", fix="write it like 2GB, 500MB or 4GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def quantize(target: str | None, out: str | None, *, flags: Mapping[str, tuple[str, Any]] | None = None,
             overrides: list[str] | tuple[str, ...] = (), verify: str | None = None,
             max_shard_size: str | int | None = None, eval_prompts: int | None = None, progress=None):
    """Everything `orbitctl quantize` does for one invocation: ``--verify OUT`` (the manifest check, a dict),
    ``PROFILE`` (:func:`quantize_profile`) or ``SRC OUT`` (:func:`run_quantize`); ``flags`` are the quant
    flags given, field -> (flag as typed, value). A flag the chosen mode does not use is a UserError."""
    flags = dict(flags or {})
    overrides = list(overrides)
    if verify:
        extra = [label for label, _ in flags.values()]
        extra += [name for name, given in (("PROFILE | SRC", target), ("OUT", out), ("--max-shard-size", max_shard_size),
                                           ("--eval-prompts", eval_prompts), ("--set", overrides)) if given not in (None, [])]
        if extra:
            raise UserError(f"--verify re-hashes a finished output and takes nothing else (got {', '.join(extra)})",
                            fix="run orbitctl quantize --verify OUT on its own (--json is fine)")
        return verify_output(verify)
    if target is None:
        raise UserError("nothing to quantize",
                        fix="pass a profile, or SRC OUT --format FMT, or --verify OUT (see orbitctl quantize --help)")
    evals = 0 if eval_prompts is None else eval_prompts
    shard = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if out is None:
        from orbitctl.profile.support import refuse_overrides_outside

        refuse_overrides_outside(overrides, ("quant", "model.path", "model.quantized_path"), "quantize PROFILE",
                                 fix="drop it: quantize writes model.path into model.quantized_path with the quant section")
        return quantize_profile(target, overrides + flag_overrides(flags, overrides), progress=progress,
                                eval_prompts=evals, **shard)
    options = src_out_options(flags, overrides)
    return run_quantize(target, out, **options, progress=progress, eval_prompts=evals, **shard)


def flag_overrides(flags: Mapping[str, tuple[str, Any]], overrides: list[str]) -> list[str]:
    """PROFILE mode: each quant flag as the ``quant.KEY=VALUE`` override it stands for."""
    import json

    from orbitctl.profile.support import given_keys

    keys = set(given_keys(overrides))
    extra = []
    for name, (label, value) in flags.items():
        clash = f"quant.{name}" if f"quant.{name}" in keys else ("quant" if "quant" in keys else None)
        if clash:
            raise UserError(f"{label} and --set {clash} both set quant.{name}", fix="give the value once")
        extra.append(f"quant.{name}={json.dumps(value)}")
    return extra


def run_quantize(src: str, out: str, *, max_shard_size: str | int | None = None, **kwargs):
    """quantize_checkpoint with a human-readable shard size (None: the converter's default)."""
    from orbitctl.quant.convert import DEFAULT_MAX_SHARD_BYTES, quantize_checkpoint

    size = DEFAULT_MAX_SHARD_BYTES if max_shard_size is None else parse_size(max_shard_size)
    return quantize_checkpoint(src, out, max_shard_bytes=size, **kwargs)


def src_out_options(flags: Mapping[str, tuple[str, Any]], overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The converter's settings for SRC OUT: explicit flags (field -> (flag, value)) and ``--set quant.KEY=VALUE``,
    validated by the profile schema's quant section, which also fills in every default."""
    from pydantic import ValidationError

    from orbitctl.profile.loader import apply_overrides
    from orbitctl.profile.schema import QuantSection
    from orbitctl.profile.support import moot_quant_keys, refuse_overrides_outside, show_value

    refuse_overrides_outside(overrides, ("quant",), "quantize SRC OUT (no profile)",
                             fix="pass the value in a profile and run orbitctl quantize PROFILE, or drop it")
    if "format" in flags:
        label, fmt = flags["format"]
        choices = get_args(QuantSection.model_fields["format"].annotation)
        if fmt not in choices:
            raise UserError(f"{label}: unknown format '{fmt}'", fix=f"use one of {', '.join(choices)}")
    data: dict[str, Any] = {}
    problems = apply_overrides(data, list(overrides))
    if problems:
        raise UserError("\n".join(problems))
    from_set = data.get("quant", {})
    if not isinstance(from_set, dict):
        raise UserError(f"--set quant={show_value(from_set)}: quant is a section",
                        fix="set its keys one by one, e.g. --set quant.group_size=32")
    labels = {name: label for name, (label, _) in flags.items()}
    values = {name: value for name, (_, value) in flags.items()}
    for name, value in from_set.items():
        if name in values and _same(values[name]) != _same(value):
            raise UserError(f"{labels[name]} {show_value(values[name])} and --set quant.{name}={show_value(value)} disagree",
                            fix="give the value once")
        labels[name] = f"--set quant.{name}"
        values[name] = value
    if "format" not in values:
        raise UserError("--format is required with SRC OUT", fix="add --format nf4 (or fp4, int4, fp8)")
    if values.get("compute_dtype") == "auto":
        raise UserError(f"{labels['compute_dtype']}=auto: SRC OUT has no profile whose hardware resolves auto",
                        fix="give bf16, fp16 or fp32, or quantize through a profile")
    try:
        quant = QuantSection.model_validate(values)
    except ValidationError as exc:
        raise UserError("\n".join(_schema_problems(exc, labels, values))) from None
    moot = moot_quant_keys(quant, labels)
    if moot:
        raise UserError("\n".join(item.render() for item in moot))
    return {"fmt": quant.format, "group_size": quant.group_size, "double_quant": quant.double_quant,
            "storage_dtype": quant.storage_dtype, "modules": quant.modules, "skip": tuple(quant.skip),
            "compute_dtype": TORCH_DTYPE_NAMES[quant.compute_dtype]}


def _same(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _schema_problems(exc, labels: Mapping[str, str], values: Mapping[str, Any]) -> list[str]:
    from orbitctl.profile.support import show_value

    lines = []
    for err in exc.errors():
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ").replace("Input should be", "must be")
        loc = [str(p) for p in err.get("loc", ())]
        if not loc:
            lines.append(msg)
            continue
        name = loc[0]
        lines.append(f"{labels.get(name, f'quant.{name}')}: {msg} (got {show_value(values.get(name))})")
    return list(dict.fromkeys(lines))


def quantize_profile(profile_path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, progress=None,
                     eval_prompts: int = 0, max_shard_size: str | int | None = None):
    """Quantize model.path into model.quantized_path with the profile's quant section."""
    from orbitctl.profile.loader import load_profile
    from orbitctl.profile.support import QUANTIZE, given_keys, refuse_unsupported
    from orbitctl.quant.convert import DEFAULT_MAX_SHARD_BYTES, quantize_checkpoint

    profile = load_profile(profile_path, overrides)
    q = profile.quant
    if not profile.model.path:
        raise UserError(f"{profile_path}: model.path is not set", fix="set model.path to the Hugging Face checkpoint directory or .gguf file to quantize "
                        "(a tiny catalog model such as the demo's is built and quantized by `orbitctl train`)")
    if not profile.model.quantized_path:
        raise UserError(f"{profile_path}: model.quantized_path is not set", fix="set model.quantized_path to the output directory")
    if q.format == "none":
        raise UserError(f"{profile_path}: quant.format is none, so there is nothing to quantize",
                        fix="the base is loaded from model.path as is; set quant.format to nf4, fp4, int4 or fp8 to quantize")
    refuse_unsupported(profile, QUANTIZE, given_keys(overrides))
    size = DEFAULT_MAX_SHARD_BYTES if max_shard_size is None else parse_size(max_shard_size)
    return quantize_checkpoint(profile.model.path, profile.model.quantized_path, fmt=q.format, group_size=q.group_size,
                               double_quant=q.double_quant, storage_dtype=q.storage_dtype, modules=q.modules,
                               skip=tuple(q.skip), progress=progress, eval_prompts=eval_prompts,
                               compute_dtype=_compute_dtype(profile), max_shard_bytes=size)


def _compute_dtype(profile) -> str:
    """quant.compute_dtype as a torch dtype name; auto is resolved for where the profile runs, as train does."""
    from orbitctl.kernels.cpu_dtype import compute_dtype_name

    return TORCH_DTYPE_NAMES[compute_dtype_name(profile)]
