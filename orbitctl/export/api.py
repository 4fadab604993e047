"""`orbitctl export` as a library call.

    from orbitctl.export.api import export
    result = export("profiles/tiny-cpu.yaml", "out/tiny-gguf", "gguf", adapter="runs/tiny-cpu/adapter")
    result.counts            # {"tensors": 20, "exact": 20, "converted": 0, "by_type": {...}}

OUT is a directory, filled under a temporary sibling name and renamed when complete (an interrupted
export leaves no OUT): ``gguf`` writes ``model.gguf`` (the frozen base), ``adapter.gguf`` (with
``--adapter``) and ``export_report.json``; ``hf-merged`` writes a bf16 Hugging Face checkpoint
(``config.json``, ``model.safetensors``, the tokenizer files) and ``export_report.json`` with the
merge cost. Everything that can be refused is refused before the base is built or read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from orbitctl.errors import UserError
from orbitctl.export.report import TensorRecord, counts
from orbitctl.rundir import atomic_dir, atomic_write_json, read_json

FORMATS = ("gguf", "hf-merged")
REPORT = "export_report.json"
Progress = Callable[[str, int, int], None]


@dataclass
class ExportResult:
    format: str
    output: str
    files: list[str]
    tensors: list[TensorRecord]
    adapter_tensors: list[TensorRecord] = field(default_factory=list)
    adapter: str | None = None
    vocab: dict | None = None
    merge_cost: dict | None = None
    seconds: float = 0.0

    @property
    def counts(self) -> dict:
        return counts(self.tensors)

    def to_dict(self) -> dict:
        return {"format": self.format, "output": self.output, "files": self.files, "adapter": self.adapter,
                "counts": self.counts, "adapter_counts": counts(self.adapter_tensors) if self.adapter_tensors else None,
                "tokenizer": self.vocab, "merge_cost": self.merge_cost, "seconds": round(self.seconds, 3),
                "tensors": [r.to_dict() for r in self.tensors],
                "adapter_tensors": [r.to_dict() for r in self.adapter_tensors]}


def export(profile_path: str, out: str, fmt: str, *, adapter: str | None = None, overrides: list[str] | None = None,
           fresh: bool = False, prompts: int = 8, progress: Progress | None = None) -> ExportResult:
    """Export the profile's frozen base (and ``adapter``) to ``out`` in ``fmt``; see the module docstring."""
    from orbitctl.export.archs import arch_for
    from orbitctl.export.gguf_lora import read_peft_lora
    from orbitctl.profile import load_profile

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: unknown export format", fix=f"use one of {', '.join(FORMATS)}")
    if prompts < 1:
        raise UserError(f"--prompts {prompts}: held-out sequences to measure the merge on", fix="use --prompts 1 or more")
    profile = load_profile(profile_path, overrides or [])
    config, where = source_config(profile, profile_path)
    arch = arch_for(config, where) if fmt == "gguf" else None
    lora = read_peft_lora(adapter) if adapter is not None else None
    target = Path(out)
    occupied = (target.is_dir() and any(target.iterdir())) or target.is_file()
    if occupied and not fresh:
        raise UserError(f"{target}: already exists", fix="remove it, choose another OUT, or pass --fresh to replace it")
    started = time.perf_counter()
    policy, base_dir, tok_dir = _prepare(profile, need_policy=fmt == "hf-merged", progress=progress)
    from orbitctl.export.base import QuantizedBase

    base = QuantizedBase(base_dir)

    def fill(tmp: Path) -> ExportResult:
        if fmt == "gguf":
            result = _gguf(base, arch, lora, tmp, tok_dir, profile.name, progress)
        else:
            result = _merged(base, lora, tmp, tok_dir, policy, profile, prompts, progress)
        result.output, result.adapter = str(target), None if adapter is None else str(adapter)
        result.seconds = time.perf_counter() - started
        result.files = sorted(p.name for p in tmp.iterdir()) + [REPORT]
        atomic_write_json(tmp / REPORT, result.to_dict())
        return result

    return atomic_dir(target, fill, replace=True)


def source_config(profile, profile_path: str) -> tuple[dict, str]:
    """The Hugging Face config of the profile's model (before anything is built) and where it is from."""
    if profile.model.quantized_path:
        path = Path(profile.model.quantized_path) / "config.json"
        return read_json(path, what="config.json", key="model.quantized_path"), str(path)
    if profile.model.path:  # a checkpoint directory's config.json, or a GGUF file's metadata (pkg: paths too)
        from orbitctl.arch.model_source import source_config as model_path_config

        return model_path_config(profile.model.path)
    if profile.model.arch:
        from orbitctl.arch.catalog import builtin_config, resolve_name
        from orbitctl.model.demo_base import demo_config

        where = f"{profile_path}: model.arch {profile.model.arch}"
        # the catalog's config names the architecture even where the demo could not build it
        return (builtin_config(profile.model.arch) if resolve_name(profile.model.arch) else demo_config(profile.model.arch)), where
    raise UserError(f"{profile_path}: model.path: not set", fix="set model.path, model.quantized_path or model.arch")


def _prepare(profile, *, need_policy: bool, progress: Progress | None):
    """(policy or None, base directory, tokenizer directory), building the base if the cache lacks it."""
    import torch

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    if progress:
        progress("preparing the base", 0, 1)
    split = load_prompts(profile.data, profile.run.seed)
    prepared = prepare_frozen_base(profile, split.warm_task)
    tok_dir = prepared.quantized_dir if (prepared.quantized_dir / "tokenizer.json").exists() or prepared.source_dir is None \
        else prepared.source_dir
    policy = None
    if need_policy:
        torch.manual_seed(profile.run.seed)
        policy = load_policy(profile, prepared, device="cpu")
    return policy, prepared.quantized_dir, tok_dir


def _gguf(base, arch, lora, tmp: Path, tok_dir: Path, name: str, progress) -> ExportResult:
    from orbitctl.export.gguf_base import write_base_gguf
    from orbitctl.export.gguf_lora import write_lora_gguf
    from orbitctl.export.vocab import read_vocab

    vocab = read_vocab(tok_dir, arch.model_type, int(base.config["vocab_size"]))
    records = write_base_gguf(base, arch, vocab, tmp / "model.gguf", name=name, progress=progress)
    adapter_records = []
    if lora is not None:
        shapes = {r.source: r.shape for r in records}
        adapter_records = write_lora_gguf(lora, arch, base.config, tmp / "adapter.gguf", name=f"{name} adapter",
                                          base_shapes=shapes)
    return ExportResult("gguf", "", [], records, adapter_records, vocab=vocab.to_dict())


def _merged(base, lora, tmp: Path, tok_dir: Path, policy, profile, prompts: int, progress) -> ExportResult:
    from orbitctl.export.compare import held_out_sequences
    from orbitctl.export.merged import merge_cost, write_merged
    from orbitctl.kernels.cpu_dtype import torch_dtype

    records = write_merged(base, lora, tmp, tok_dir, progress)
    if lora is not None:
        from orbitctl.align.selfcheck import load_adapter_into

        load_adapter_into(policy, lora.path, "lora")
    if progress:
        progress("measuring the merge", 0, 1)
    seqs = held_out_sequences(profile, policy, prompts)
    cost = merge_cost(policy, tmp, seqs, torch_dtype(profile.quant.compute_dtype, "cpu"), adapter=lora is not None)
    return ExportResult("hf-merged", "", [], records, merge_cost=cost)
