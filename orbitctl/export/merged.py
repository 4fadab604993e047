"""The base dequantized and the adapter merged: a bf16 Hugging Face checkpoint any runtime loads.

Each weight is decoded in float32 exactly as the frozen base decodes it, the LoRA product added
there (``W + (alpha / r) B A``, float32), and the sum rounded once to bf16. That rounding, and the
merged model computing ``(W + s B A) x`` where the train path computes ``W x + s B (A x)`` in its
compute dtype, is what merging costs; :func:`merge_cost` measures it on held-out sequences against
the train path (orbitctl's frozen quantized base with the unmerged adapter) and states it in ulps of
the compute dtype at the largest logit, beside :func:`orbitctl.align.floor.dtype_bound`.

The merged tensors are held in memory until they are written (one bf16 copy of the model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from orbitctl.export.base import QuantizedBase
from orbitctl.export.gguf_lora import PeftLora
from orbitctl.export.report import CONVERTED, EXACT, TensorRecord

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def write_merged(base: QuantizedBase, lora: PeftLora | None, out: Path, tokenizer_dir: Path,
                 progress: Callable[[str, int, int], None] | None = None) -> list[TensorRecord]:
    """Write model.safetensors, config.json and the tokenizer files into ``out``."""
    from safetensors.torch import save_file

    pairs = {p.module + ".weight": p for p in (lora.pairs if lora else [])}
    tensors: dict[str, torch.Tensor] = {}
    records = []
    names = base.names()
    for done, name in enumerate(names, start=1):
        weight = base.read(name)
        wide = weight.decoded()
        pair = pairs.pop(name, None)
        if pair is not None:
            wide = wide + lora.scale * (pair.b.to(torch.float32) @ pair.a.to(torch.float32))
        merged = wide.to(torch.bfloat16)
        rounded = int((merged.to(torch.float32) != wide).sum())
        if pair is not None:
            status, why = CONVERTED, f"W + {lora.scale:g} B A in float32, rounded to bf16 ({rounded} values rounded)"
        elif rounded:
            status, why = CONVERTED, f"decoded {weight.describe()} rounded to bf16 ({rounded} values)"
        else:
            status, why = EXACT, f"decoded {weight.describe()}, exact in bf16"
        tensors[name] = merged.contiguous()
        records.append(TensorRecord(name, name, weight.describe(), "BF16", status, why, weight.shape))
        if progress:
            progress("merging", done, len(names))
    if pairs:
        missing = next(iter(pairs))
        from orbitctl.errors import UserError

        raise UserError(f"{lora.path}: adapts '{missing}', which the base has no weight for",
                        fix="merge the adapter into the base it was trained on")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in base.config.items() if k != "quantization_config"}
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out / name)
    return records


def merge_cost(policy, merged_dir: Path, seqs: list[list[int]], compute_dtype: torch.dtype, adapter: bool) -> dict:
    """The merged checkpoint (loaded by transformers) against the train path on ``seqs``."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from orbitctl.align.floor import dtype_bound, dtype_eps
    from orbitctl.export.compare import distances, model_logits, train_path_logits
    from orbitctl.model.adapters import adapters_disabled

    model = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=compute_dtype)
    model.eval()
    merged = model_logits(model, seqs, policy.pad_id)
    with contextlib.nullcontext() if adapter else adapters_disabled(policy.model):
        train = train_path_logits(policy, seqs)
    cost = distances(train, merged)
    dtype_name = str(compute_dtype).removeprefix("torch.")
    cost["compute_dtype"] = dtype_name
    cost["sequences"] = len(seqs)
    cost["ulps_at_logit_absmax"] = cost["max_abs_logit_diff"] / (dtype_eps(dtype_name) * cost["logit_absmax"])
    cost["dtype_bound_1ulp"] = dtype_bound(dtype_name, cost["logit_absmax"])
    return cost
