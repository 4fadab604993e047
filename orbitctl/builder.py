"""From a profile to the frozen quantized base on disk, then to a :class:`Policy` in memory.

Sources, in order: ``model.quantized_path`` (used as is), ``model.path`` (quantized once into
the cache), or, for a tiny catalog architecture, the demo checkpoint built by code
(:mod:`orbitctl.model.demo_base`, warm-started on the caller's task) and then quantized. The cache key covers every input, so a
cached base is always the one the profile describes; ``ORBITCTL_CACHE`` moves the cache.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import UserError
from orbitctl.kernels import cpu_dtype
from orbitctl.rundir import atomic_dir, cache_root
from orbitctl.units import TORCH_DTYPE_NAMES


@dataclass(frozen=True)
class PreparedBase:
    quantized_dir: Path
    source_dir: Path | None
    built: bool
    """True when this call built or quantized something (False: served from the cache)."""
    notes: dict


def _quant_settings(profile) -> dict:
    # compute_dtype as resolved here (auto -> bf16 or fp32): it is written into the checkpoint's config; the INT4
    # scales' significant bits: a cached base quantized with other scales is quantized again
    from orbitctl.codec.formats import SCALE_BITS

    return {**profile.quant.model_dump(mode="json"), "compute_dtype": cpu_dtype.compute_dtype_name(profile),
            "int4_scale_bits": SCALE_BITS}


def quantize_into(source: Path, out: Path, profile) -> None:
    from orbitctl.quant.convert import quantize_checkpoint

    q = profile.quant
    quantize_checkpoint(str(source), str(out), fmt=q.format, group_size=q.group_size, double_quant=q.double_quant,
                        storage_dtype=q.storage_dtype, modules=q.modules, skip=list(q.skip),
                        compute_dtype=TORCH_DTYPE_NAMES[cpu_dtype.compute_dtype_name(profile)])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists() and not (out / name).exists():
            shutil.copy2(source / name, out / name)


def prepare_frozen_base(profile, task) -> PreparedBase:
    """The quantized base directory for this profile, building and quantizing what is missing.

    ``task`` (a :class:`~orbitctl.data.tasks.BuiltinTask`) warm-starts the demo base of a tiny catalog
    architecture; the caller picks it (:attr:`~orbitctl.data.prompts.PromptSplit.warm_task`).
    """
    from orbitctl.model.demo_base import WarmStart, build_demo_checkpoint, demo_config, recipe_key

    if profile.model.quantized_path:
        path = Path(profile.model.quantized_path)
        if not (path / "config.json").exists():
            raise UserError(f"model.quantized_path: {path} has no config.json",
                            fix="run `orbitctl quantize PROFILE` first or fix the path")
        return PreparedBase(path, None, False, {})
    if profile.model.path:
        from orbitctl.arch.model_source import is_gguf, resolve_model_path

        source = resolve_model_path(profile.model.path)  # a directory or a .gguf file, pkg:PACKAGE/PATH too
        if not is_gguf(source) and not (source / "config.json").exists():
            raise UserError(f"model.path: {source} has no config.json", fix="point model.path at a Hugging Face checkpoint directory")
        import hashlib

        key = hashlib.sha256(f"{source.resolve()}|{sorted(_quant_settings(profile).items())}".encode()).hexdigest()[:16]
        out = cache_root() / "quantized" / key
        built = not out.exists()
        if built:
            atomic_dir(out, lambda tmp: quantize_into(source, tmp, profile))
        return PreparedBase(out, source, built, {})
    if not profile.model.arch:
        raise UserError("model.path: not set, and only a tiny catalog architecture can be built by code",
                        fix="set model.path to a Hugging Face checkpoint, or model.arch: tiny-llama")
    config = demo_config(profile.model.arch)
    warm = WarmStart(seed=profile.run.seed)
    key = recipe_key(config, task, warm, {"quant": _quant_settings(profile)})
    root = cache_root() / "demo" / key
    source, quantized = root / "hf", root / profile.quant.format
    notes: dict = {}
    built = False
    if not source.exists():
        notes = atomic_dir(source, lambda tmp: build_demo_checkpoint(tmp, config, task, warm))
        built = True
    if not quantized.exists():
        atomic_dir(quantized, lambda tmp: quantize_into(source, tmp, profile))
        built = True
    return PreparedBase(quantized, source, built, notes)


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
    from orbitctl.model.frozen_base import apply_int4_kernel, attention_kernel, load_frozen_base
    from orbitctl.kernels.cpu_dtype import torch_dtype
    from orbitctl.model.expert_parallel import Lockstep
    from orbitctl.model.policy import Policy

    device = device or policy_device(profile)
    experts = expert_group(profile)
    tok_dir = base.quantized_dir if (base.quantized_dir / "tokenizer.json").exists() or base.source_dir is None else base.source_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if profile.data.chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"data.chat_template: the tokenizer in {tok_dir} has no chat template",
                        fix="set data.chat_template: false, or use a model whose tokenizer_config.json has a chat_template")
    model = load_frozen_base(str(base.quantized_dir), device=device,
                             compute_dtype=torch_dtype(profile.quant.compute_dtype, device), experts=experts,
                             attention=attention_kernel(profile.memory.flash_attention))
    apply_int4_kernel(model, profile, device)
    hidden = int(model.config.hidden_size)
    attach = attach_lora if profile.adapter.kind == "lora" else attach_bottleneck
    model, report = attach(model, profile.adapter, hidden, seed=profile.run.seed)
    report = replace(report, dtypes=cpu_dtype.dtype_summary(profile, device))
    graphs = decode_graphs(profile, device)
    return Policy(model, tokenizer, report, hidden_size=hidden, adapter_kind=profile.adapter.kind,
                  gradient_checkpointing=profile.memory.gradient_checkpointing,
                  keep_frozen_outputs=profile.memory.keep_frozen_outputs,
                  lockstep=Lockstep() if experts is not None else None, chat_template=profile.data.chat_template,
                  kv_dtype=profile.rollout.kv_dtype, router_replay=profile.rl.router_replay,
                  system_prompt=profile.data.system_prompt, decode_graphs=graphs,
                  continuous_batching=profile.rollout.continuous_batching is not False and not graphs)


def decode_graphs(profile, device: str) -> bool:
    """Whether the infer path on ``device`` decodes from CUDA graphs: rollout.decode_graphs, ``auto`` resolved by the
    plan (:func:`orbitctl.plan.resolve_decode_graphs`: graphs where it predicts them faster, never with
    rollout.continuous_batching true); never off a GPU. Continuous batching runs wherever this is False."""
    if not str(device).startswith("cuda"):
        return False
    from orbitctl.plan import resolve_decode_graphs

    return resolve_decode_graphs(profile).rollout.decode_graphs is True


def expert_group(profile):
    """This rank's expert-parallel group (:class:`~orbitctl.model.expert_parallel.ExpertGroup`), or None: no
    expert parallelism asked, or one process alone, which then holds every expert."""
    if profile.memory.expert_parallel <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from orbitctl.model.expert_parallel import ExpertGroup

    return ExpertGroup.of_world(profile.memory.expert_parallel)
