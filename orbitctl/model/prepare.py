"""From a profile to the frozen quantized base on disk, then to a :class:`Policy` in memory.

Sources, in order: ``model.quantized_path`` (used as is), ``model.path`` (quantized once into
the cache), or, for a tiny catalog architecture, the demo checkpoint built by code
(:mod:`orbitctl.model.demo_base`) and then quantized. The cache key covers every input, so a
cached base is always the one the profile describes; ``ORBITCTL_CACHE`` moves the cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import UserError


@dataclass(frozen=True)
class PreparedBase:
    quantized_dir: Path
    source_dir: Path | None
    built: bool
    """True when this call built or quantized something (False: served from the cache)."""
    notes: dict


def cache_root() -> Path:
    return Path(os.environ.get("ORBITCTL_CACHE") or Path.home() / ".cache" / "orbitctl")


def _atomic_dir(final: Path, fill) -> dict:
    """Fill a temp dir next to ``final`` and rename it into place (a killed build leaves no half dir)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        notes = fill(tmp) or {}
        if final.exists():  # another process finished first; theirs is identical
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)
        return notes
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _quant_settings(profile) -> dict:
    # compute_dtype as resolved here (auto -> bf16 or fp32): it is written into the checkpoint's config
    return {**profile.quant.model_dump(mode="json"), "compute_dtype": compute_dtype_name(profile)}


def run_device_type(profile) -> str:
    """'cuda' when the profile names a GPU and CUDA is there, else 'cpu' (as :func:`policy_device`)."""
    if profile.hardware.gpu == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype_name(profile) -> str:
    """quant.compute_dtype resolved for where this profile runs: bf16, fp16 or fp32."""
    from orbitctl.model.cpu_dtype import resolved_dtype

    return resolved_dtype(profile.quant.compute_dtype, run_device_type(profile))


def dtype_summary(profile, device=None) -> str:
    """One line: the compute and adapter dtypes a run on ``device`` uses, and why when they came from auto."""
    from orbitctl.model.cpu_dtype import describe

    device = device or run_device_type(profile)
    compute, adapter = describe(profile.quant.compute_dtype, device), describe(profile.adapter.dtype, device)
    return f"compute {compute}; adapter {adapter}" if adapter != compute else f"compute and adapter {compute}"


def quantize_into(source: Path, out: Path, profile) -> None:
    from orbitctl.model.cpu_dtype import DTYPE_NAMES
    from orbitctl.quant.convert import quantize_checkpoint

    q = profile.quant
    quantize_checkpoint(str(source), str(out), fmt=q.format, group_size=q.group_size, double_quant=q.double_quant,
                        storage_dtype=q.storage_dtype, modules=q.modules, skip=list(q.skip),
                        compute_dtype=DTYPE_NAMES[compute_dtype_name(profile)])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists() and not (out / name).exists():
            shutil.copy2(source / name, out / name)


def prepare_frozen_base(profile, task=None) -> PreparedBase:
    """The quantized base directory for this profile, building and quantizing what is missing."""
    from orbitctl.model.demo_base import WarmStart, build_demo_checkpoint, demo_config, recipe_key

    if profile.model.quantized_path:
        path = Path(profile.model.quantized_path)
        if not (path / "config.json").exists():
            raise UserError(f"model.quantized_path: {path} has no config.json",
                            fix="run `orbitctl quantize PROFILE` first or fix the path")
        return PreparedBase(path, None, False, {})
    if profile.model.path:
        source = Path(profile.model.path)
        if not (source / "config.json").exists():
            raise UserError(f"model.path: {source} has no config.json", fix="point model.path at a Hugging Face checkpoint directory")
        import hashlib

        key = hashlib.sha256(f"{source.resolve()}|{sorted(_quant_settings(profile).items())}".encode()).hexdigest()[:16]
        out = cache_root() / "quantized" / key
        built = not out.exists()
        if built:
            _atomic_dir(out, lambda tmp: quantize_into(source, tmp, profile))
        return PreparedBase(out, source, built, {})
    if not profile.model.arch:
        raise UserError("model.path: not set, and only a tiny catalog architecture can be built by code",
                        fix="set model.path to a Hugging Face checkpoint, or model.arch: tiny-llama")
    if task is None:
        # JSONL data on a tiny catalog model: the base is the demo's, warm-started on the echo
        # task (answer format: a short completion then EOS; reading digits from the prompt)
        from orbitctl.rl.tasks import builtin_task

        task = builtin_task("mod3")
    config = demo_config(profile.model.arch)
    warm = WarmStart(seed=profile.run.seed)
    key = recipe_key(config, task, warm, {"quant": _quant_settings(profile)})
    root = cache_root() / "demo" / key
    source, quantized = root / "hf", root / profile.quant.format
    notes: dict = {}
    built = False
    if not source.exists():
        notes = _atomic_dir(source, lambda tmp: build_demo_checkpoint(tmp, config, task, warm))
        built = True
    if not quantized.exists():
        _atomic_dir(quantized, lambda tmp: quantize_into(source, tmp, profile))
        built = True
    return PreparedBase(quantized, source, built, notes)


def quant_summary(quantized_dir: Path) -> str | None:
    """One line from the converter's quant_report.json: what the frozen base costs in bits and error."""
    import json

    report_file = Path(quantized_dir) / "quant_report.json"
    if not report_file.exists():
        return None
    report = json.loads(report_file.read_text())
    kinds = report.get("summary", {}).get("quantized", {})
    params = sum(k.get("params", 0) for k in kinds.values()) or 1
    rel = sum(k.get("rel_fro_error", 0.0) * k.get("params", 0) for k in kinds.values()) / params
    fmt = report.get("format")
    fmt = fmt.get("format") if isinstance(fmt, dict) else fmt
    return (f"{fmt}: {report.get('quantized_params', 0):,} weights quantized, "
            f"{report.get('bits_per_weight_quantized', 0):.2f} bits/weight, relative error {rel:.3f} "
            f"({report_file})")


def policy_device(profile) -> str:
    """This rank's GPU when the profile names one and CUDA is there (LOCAL_RANK picks it), else the CPU."""
    import torch

    if profile.hardware.gpu == "cpu" or not torch.cuda.is_available():
        return "cpu"
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def load_policy(profile, base: PreparedBase, device: str | None = None):
    """The frozen base from disk with fresh adapters attached, as a :class:`Policy`, on ``device``
    (default :func:`policy_device`): the base is loaded straight onto it, never whole on the host."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from orbitctl.model.adapters import attach_bottleneck, attach_lora
    from orbitctl.model.base import load_frozen_base
    from orbitctl.model.cpu_dtype import torch_dtype
    from orbitctl.model.policy import Policy

    device = device or policy_device(profile)
    model = load_frozen_base(str(base.quantized_dir), device=device,
                             compute_dtype=torch_dtype(profile.quant.compute_dtype, device))
    tok_dir = base.quantized_dir if (base.quantized_dir / "tokenizer.json").exists() or base.source_dir is None else base.source_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    hidden = int(model.config.hidden_size)
    attach = attach_lora if profile.adapter.kind == "lora" else attach_bottleneck
    model, report = attach(model, profile.adapter, hidden, seed=profile.run.seed)
    report = replace(report, dtypes=dtype_summary(profile, device))
    return Policy(model, tokenizer, report, hidden_size=hidden, adapter_kind=profile.adapter.kind,
                  gradient_checkpointing=profile.memory.gradient_checkpointing)
