"""The quality report: what quantization did to every weight, and to the next-token distribution.

Per tensor: relative Frobenius error ||W - Q(W)|| / ||W||, max abs error, SQNR in dB. Per
module kind (attention, dense MLP, shared experts, routed experts) the sums are pooled, so
the kind's error is the error of all its weights taken together. Bytes in/out and bits per
weight count every stored tensor, metadata included. For a GGUF source every tensor's row
also says what became of it: copied exactly (a Q4_0 weight into int4 group 32), decoded and
requantized, or decoded and kept unquantized (in bf16). The file ``quant_report.json`` holds
no timings, so two runs over the same input write the same bytes.
"""

from __future__ import annotations

import math

import torch
from pathlib import Path

SUMMARY_KINDS = ("attention", "mlp", "shared_experts", "experts", "lm_head")
STATS_CHUNK = 1 << 17


def tensor_stats(name: str, kind: str, original: torch.Tensor, restored: torch.Tensor, bytes_in: int, bytes_out: int) -> dict:
    """Error of one quantized weight against the weight it came from."""
    err_sq = ref_sq = max_abs = 0.0
    flat_w, flat_r = original.reshape(-1), restored.reshape(-1)
    err = torch.empty(min(STATS_CHUNK, flat_w.numel()), dtype=torch.float32)
    ref = torch.empty_like(err)
    # cache-sized chunks: the float32 error never exists for the whole matrix, and both float32
    # copies are preallocated (mixed-dtype ops would cast into a fresh temporary per chunk)
    for s in range(0, flat_w.numel(), STATS_CHUNK):
        w = ref[: min(STATS_CHUNK, flat_w.numel() - s)]
        w.copy_(flat_w[s:s + STATS_CHUNK])
        e = err[: w.numel()]
        e.copy_(flat_r[s:s + STATS_CHUNK])
        e.sub_(w)  # in float32: a bf16 difference would round away the error being measured
        err_sq += float(torch.dot(e, e))
        ref_sq += float(torch.dot(w, w))
        lo, hi = torch.aminmax(e)
        max_abs = max(max_abs, -float(lo), float(hi))
    return {
        "name": name, "kind": kind, "shape": list(original.shape), "params": original.numel(),
        "bytes_in": bytes_in, "bytes_out": bytes_out,
        "rel_fro_error": _rel(err_sq, ref_sq), "max_abs_error": max_abs,
        "sqnr_db": _sqnr(err_sq, ref_sq), "err_sq": err_sq, "ref_sq": ref_sq,
    }


def _rel(err_sq: float, ref_sq: float) -> float:
    return math.sqrt(err_sq / ref_sq) if ref_sq > 0 else 0.0


def _sqnr(err_sq: float, ref_sq: float) -> float | None:
    if err_sq == 0:
        return None  # exact: infinite SQNR, JSON has no inf
    return 10.0 * math.log10(ref_sq / err_sq) if ref_sq > 0 else None


def summarize(quantized: list[dict], kept: list[dict]) -> dict:
    """Per module kind: count, params, pooled relative error and SQNR, worst tensor, bits per weight."""
    kinds: dict[str, dict] = {}
    for t in quantized:
        k = kinds.setdefault(t["kind"], {"tensors": 0, "params": 0, "bytes_in": 0, "bytes_out": 0, "err_sq": 0.0,
                                         "ref_sq": 0.0, "max_abs_error": 0.0, "worst_rel_fro_error": 0.0, "worst_tensor": None})
        k["tensors"] += 1
        k["params"] += t["params"]
        k["bytes_in"] += t["bytes_in"]
        k["bytes_out"] += t["bytes_out"]
        k["err_sq"] += t.get("err_sq", 0.0)
        k["ref_sq"] += t.get("ref_sq", 0.0)
        k["max_abs_error"] = max(k["max_abs_error"], t.get("max_abs_error") or 0.0)
        if (t.get("rel_fro_error") or 0.0) >= k["worst_rel_fro_error"]:
            k["worst_rel_fro_error"], k["worst_tensor"] = t.get("rel_fro_error") or 0.0, t["name"]
    out = {}
    for kind in sorted(kinds, key=lambda k: (SUMMARY_KINDS.index(k) if k in SUMMARY_KINDS else 99, k)):
        k = kinds[kind]
        out[kind] = {
            "tensors": k["tensors"], "params": k["params"], "bytes_in": k["bytes_in"], "bytes_out": k["bytes_out"],
            "rel_fro_error": _rel(k["err_sq"], k["ref_sq"]), "sqnr_db": _sqnr(k["err_sq"], k["ref_sq"]),
            "max_abs_error": k["max_abs_error"], "worst_rel_fro_error": k["worst_rel_fro_error"], "worst_tensor": k["worst_tensor"],
            "bits_per_weight": _bits_per_weight(k) or 0.0,
        }
    kept_kinds: dict[str, dict] = {}
    for t in kept:
        k = kept_kinds.setdefault(t["kind"], {"tensors": 0, "params": 0, "bytes_out": 0})
        k["tensors"] += 1
        k["params"] += t["params"]
        k["bytes_out"] += t["bytes_out"]
    for k in kept_kinds.values():
        k["bits_per_weight"] = _bits_per_weight(k)
    return {"quantized": out, "kept": dict(sorted(kept_kinds.items()))}


def _bits_per_weight(kind: dict) -> float | None:
    """Stored bits per parameter of a module kind (None for a kind without parameters)."""
    return 8.0 * kind["bytes_out"] / kind["params"] if kind["params"] else None


def build_report(*, source: str, spec: dict, quantized: list[dict], kept: list[dict],
                 passthrough: bool, bytes_in: int, bytes_out: int) -> dict:
    """The whole ``quant_report.json`` document."""
    q_params = sum(t["params"] for t in quantized)
    q_bytes = sum(t["bytes_out"] for t in quantized)
    all_params = q_params + sum(t["params"] for t in kept)
    return {
        "source": source,
        "format": spec,
        "passthrough": passthrough,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "params": all_params,
        "quantized_params": q_params,
        "bits_per_weight_quantized": 8.0 * q_bytes / q_params if q_params else None,
        "bits_per_weight_model": 8.0 * bytes_out / all_params if all_params else None,
        "summary": summarize(quantized, kept),
        "tensors": [{k: v for k, v in t.items() if k not in ("err_sq", "ref_sq")} for t in quantized],
        "kept": [{k: t[k] for k in ("name", "kind", "reason", "dtype", "source_type", "conversion") if k in t} for t in kept],
        "notes": notes(kept),
    } | source_conversions(quantized + kept)


CONVERSIONS = ("lossless", "requantized", "kept")


def source_conversions(rows: list[dict]) -> dict:
    """For a GGUF source: how many tensors of each source type were copied exactly (``lossless``), decoded and
    requantized, or decoded and kept unquantized in bf16; empty for other sources."""
    counts: dict[str, dict[str, int]] = {}
    for t in rows:
        if "conversion" in t:
            by_type = counts.setdefault(t["conversion"], {})
            by_type[t["source_type"]] = by_type.get(t["source_type"], 0) + 1
    if not counts:
        return {}
    return {"source_conversion": {c: dict(sorted(counts[c].items())) for c in CONVERSIONS if c in counts}}


ROUTINE_REASONS = ("not a linear weight", "stays bf16", "quant.skip", "quant.modules", "format none", "copied as is")


def notes(kept: list[dict]) -> list[str]:
    """Linear weights kept in bf16 for a reason the user did not ask for, counted once per reason."""
    counts: dict[str, int] = {}
    for t in kept:
        if not any(r in t["reason"] for r in ROUTINE_REASONS):
            counts[t["reason"]] = counts.get(t["reason"], 0) + 1
    return [f"{n} weight(s) kept bf16: {reason}" for reason, n in sorted(counts.items())]


def compare_next_token(src: str, out: str, num_prompts: int, *, seq_len: int = 16, seed: int = 0) -> dict:
    """Original vs quantized next-token distributions on ``num_prompts`` seeded random prompts.

    Every position of every prompt counts as one next-token distribution. Needs the
    original model to fit in host memory (it is loaded whole, in bf16).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from orbitctl.distances import js_divergence, logsoftmax_l1, topk_agreement
    from orbitctl.model.frozen_base import load_frozen_base

    hf_logging.disable_progress_bar()  # stderr belongs to orbitctl's own progress bar
    source = Path(src)
    # a GGUF source through transformers' own GGUF loader (dequantized), an independent decoder of the file
    where = {"pretrained_model_name_or_path": str(source.parent), "gguf_file": source.name} if source.is_file() \
        else {"pretrained_model_name_or_path": src}
    original = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.bfloat16, device_map="cpu").eval()
    quantized = load_frozen_base(out).eval()
    vocab = original.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (num_prompts, seq_len), generator=gen)
    js, l1, top1 = [], [], []
    with torch.no_grad():
        for row in prompts:
            ids = row.unsqueeze(0)
            logp_a = torch.log_softmax(original(ids).logits.float(), -1)
            logp_b = torch.log_softmax(quantized(ids).logits.float(), -1)
            js.append(js_divergence(logp_a, logp_b).flatten())
            l1.append(logsoftmax_l1(logp_a, logp_b).flatten())
            top1.append(topk_agreement(logp_a, logp_b, k=1).flatten())
    js_all, l1_all, top_all = torch.cat(js), torch.cat(l1), torch.cat(top1)
    return {
        "prompts": num_prompts, "positions": int(js_all.numel()), "seq_len": seq_len, "seed": seed,
        "js_mean": float(js_all.mean()), "js_max": float(js_all.max()),
        "top1_agreement": float(top_all.mean()), "logsoftmax_l1_mean": float(l1_all.mean()),
    }


def quant_summary(quantized_dir: Path) -> str | None:
    """One line from the converter's quant_report.json: what the frozen base costs in bits and error."""
    from orbitctl.quant.manifest import REPORT_NAME
    from orbitctl.rundir import read_json_or_none

    report_file = Path(quantized_dir) / REPORT_NAME
    report = read_json_or_none(report_file)
    if not isinstance(report, dict):
        return None
    kinds = report.get("summary", {}).get("quantized", {})
    params = sum(k.get("params", 0) for k in kinds.values()) or 1
    rel = sum(k.get("rel_fro_error", 0.0) * k.get("params", 0) for k in kinds.values()) / params
    fmt = report.get("format")
    fmt = fmt.get("format") if isinstance(fmt, dict) else fmt
    bits = report.get("bits_per_weight_quantized")  # None when nothing was quantized (format none)
    return (f"{fmt}: {report.get('quantized_params', 0):,} weights quantized, "
            f"{'-' if bits is None else f'{bits:.2f}'} bits/weight, relative error {rel:.3f} "
            f"({report_file})")
