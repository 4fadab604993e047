"""The output directory of a conversion: fresh, resumable or complete; and how it is finished.

Finishing writes, in this order: the shard index, config.json with its quantization_config,
the tokenizer and generation files (copied from a checkpoint directory, or built from a GGUF
file's metadata), the quality report, and the manifest last of all.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from orbitctl.arch import tied_embeddings
from orbitctl.errors import UserError
from orbitctl.quant import manifest as mf
from orbitctl.codec.qconfig import quantization_config
from orbitctl.quant.report import build_report, compare_next_token
from orbitctl.codec.source import INDEX_NAME
from orbitctl.rundir import PARTIAL_SUFFIX, atomic_file, atomic_write_json, read_json_or_none

# Files of a checkpoint that describe weights, not the model: never copied next to the output.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


@dataclass
class OutputState:
    complete: bool = False
    done: dict[str, dict] = field(default_factory=dict)
    report: dict = field(default_factory=dict)


def prepare_output(out: Path, plan: dict) -> OutputState:
    """Create ``out``, or find the unfinished (or finished) run of the same conversion in it.

    Any other non-empty directory is refused: the converter never mixes two runs' files.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory", fix="choose another output directory")
    out.mkdir(parents=True, exist_ok=True)
    same = lambda doc: doc and doc.get("fingerprint") == plan["fingerprint"] and doc.get("options") == plan["options"]  # noqa: E731
    manifest = read_json_or_none(out / mf.MANIFEST_NAME)
    if manifest is not None:
        if same(manifest.get("source", {}) | {"options": manifest.get("options")}):
            return OutputState(complete=True, report=read_json_or_none(out / mf.REPORT_NAME) or {})
        raise UserError(f"{out}: holds a finished conversion of another source or with other options",
                        fix="choose an empty output directory (or delete this one)")
    existing_plan = read_json_or_none(out / mf.PLAN_NAME)
    if existing_plan is not None:
        if not same(existing_plan) or existing_plan.get("shards") != plan["shards"]:
            raise UserError(f"{out}: holds an unfinished conversion of another source or with other options",
                            fix="rerun with the original arguments to resume it, or choose an empty directory")
        for partial in out.glob("*" + PARTIAL_SUFFIX):
            partial.unlink()
        done = {}
        for name, record in mf.read_progress(out).items():
            path = out / name
            if path.exists() and path.stat().st_size == record["bytes"] and mf.sha256_file(path) == record["sha256"]:
                done[name] = record
        return OutputState(done=done)
    if any(out.iterdir()):
        raise UserError(f"{out}: output directory is not empty and holds no resumable orbitctl quantize run",
                        fix="choose an empty or new directory")
    atomic_write_json(out / mf.PLAN_NAME, plan)
    return OutputState()


def finish_output(ckpt, out: Path, plan: dict, records: list[dict], opts, passthrough: bool, eval_prompts: int) -> dict:
    """Index, config, side files, (evaluation), report, then the manifest; returns the report."""
    weight_map = {t: r["shard"] for r in records for t in r["tensors"]}
    if len(records) > 1:
        total = sum(r["bytes"] for r in records)
        atomic_write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    quantized = [t for r in records for t in r["quantized"]]
    kept = [t for r in records for t in r["kept"]]
    atomic_write_json(out / "config.json", output_config(ckpt.config, opts, kept, passthrough))
    if ckpt.side_dir is not None:
        copy_side_files(ckpt.side_dir, out)
    else:
        write_gguf_side_files(ckpt, out)
    bytes_out = sum(r["bytes"] for r in records)
    report = build_report(source=str(ckpt.path), spec=opts.spec.describe(), quantized=quantized, kept=kept,
                          passthrough=passthrough, bytes_in=ckpt.source_bytes(), bytes_out=bytes_out)
    if eval_prompts > 0:
        report["eval"] = compare_next_token(str(ckpt.path), str(out), eval_prompts)
    atomic_write_json(out / mf.REPORT_NAME, report)
    shard_hashes = {r["shard"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in records}  # hashed when written
    files = {p.name: shard_hashes.get(p.name) or {"sha256": mf.sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".") and p.name != mf.MANIFEST_NAME}
    manifest = {
        "version": mf.MANIFEST_VERSION,
        "tool": "orbitctl quantize",
        "format": opts.spec.describe(),
        "source": {"path": str(ckpt.path), "fingerprint": plan["fingerprint"]},
        "options": plan["options"],
        "files": files,
    }
    atomic_write_json(out / mf.MANIFEST_NAME, manifest)
    (out / mf.PLAN_NAME).unlink(missing_ok=True)
    (out / mf.PROGRESS_NAME).unlink(missing_ok=True)
    return report


def output_config(config: dict, opts, kept: list[dict], passthrough: bool) -> dict:
    """The source config with the quantization_config of the output format."""
    out = dict(config)
    if passthrough:
        return out
    # bitsandbytes only ever converts nn.Linear; transformers 5 holds routed experts fused, not as nn.Linear
    kinds = ("lm_head", "attention", "mlp", "shared_experts") + (() if opts.spec.fmt in ("nf4", "fp4") else ("experts",))
    linear_kept = {k["name"][: -len(".weight")] for k in kept if k["name"].endswith(".weight") and k["kind"] in kinds}
    if tied_embeddings(config):  # no lm_head tensor to keep, but the loaders must not make it a 4-bit layer
        linear_kept.add("lm_head")
    linear_kept = sorted(linear_kept)
    qc = quantization_config(opts.spec, linear_kept, opts.compute_dtype)
    if qc is None:
        out.pop("quantization_config", None)
    else:
        out["quantization_config"] = qc
    return out


def write_gguf_side_files(ckpt, out: Path) -> None:
    """A GGUF file's tokenizer and chat template as Hugging Face files (tokenizer.json, tokenizer_config.json
    with ``chat_template``) and generation_config.json, built by transformers' GGUF tokenizer loader. A file
    without tokenizer metadata gets only generation_config.json."""
    import json
    import tempfile

    generation = {k: ckpt.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ckpt.config}
    atomic_write_json(out / "generation_config.json", generation)
    if "tokenizer.ggml.model" not in ckpt.reader.fields:
        return
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name)
    except Exception as exc:  # transformers raises ValueError/KeyError/TypeError for a tokenizer it cannot build
        raise UserError(f"{ckpt.path}: transformers cannot build the tokenizer from the GGUF metadata "
                        f"({type(exc).__name__}: {exc})".splitlines()[0],
                        fix="quantize a Hugging Face checkpoint directory with its tokenizer files instead") from None
    with tempfile.TemporaryDirectory(prefix="orbitctl-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        config_file = Path(tmp) / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        if tokenizer.chat_template:  # in tokenizer_config.json itself, where every transformers version reads it
            config["chat_template"] = tokenizer.chat_template
        atomic_write_json(out / "tokenizer_config.json", config)
        for name in ("tokenizer.json", "special_tokens_map.json"):
            if (Path(tmp) / name).exists():
                with atomic_file(out / name, fsync=False) as dest:
                    shutil.copyfile(Path(tmp) / name, dest)


def copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template, remote code: every top-level file that is not weights."""
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.name in ("config.json", INDEX_NAME, mf.MANIFEST_NAME, mf.REPORT_NAME) or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.name.endswith(".index.json"):
            continue
        with atomic_file(out / path.name, fsync=False) as tmp:
            shutil.copyfile(path, tmp)

