"""Which checkpoint tensors are quantized, and what kind of module each belongs to.

Names are the on-disk Hugging Face names. transformers 5 fuses routed experts in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H]) but writes and reads them per expert
(``mlp.experts.N.gate_proj.weight``), so the converter sees one 2-D matrix per expert and
projection for llama, qwen3_moe, deepseek_v3 and Kimi-K2 alike.
"""

from __future__ import annotations

import re

ATTENTION_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_a_proj", "q_b_proj",
                     "kv_a_proj_with_mqa", "kv_b_proj"}
MLP_LINEARS = {"gate_proj", "up_proj", "down_proj", "gate_up_proj"}
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
SHARED_EXPERT = re.compile(r"\.shared_experts?\.")

KINDS = ("attention", "mlp", "shared_experts", "experts", "lm_head", "embedding", "norm", "router", "other")


def module_kind(name: str) -> str:
    """attention, mlp (dense), shared_experts, experts (routed), lm_head, embedding, norm, router or other."""
    parts = name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else name
    if name.startswith("lm_head."):
        return "lm_head"
    if "embed" in name:
        return "embedding"
    if "norm" in leaf or leaf.endswith("layernorm"):
        return "norm"
    if leaf in ATTENTION_LINEARS or ".self_attn." in name and leaf.endswith("_proj"):
        return "attention"
    if leaf in MLP_LINEARS:
        if ROUTED_EXPERT.search(name):
            return "experts"
        if SHARED_EXPERT.search(name):
            return "shared_experts"
        return "mlp"
    if leaf in ("gate", "router") or name.endswith("e_score_correction_bias"):
        return "router"
    return "other"


def quant_decision(name: str, ndim: int, *, modules: str = "all-linear", skip: tuple[str, ...] = ("lm_head",)) -> str | None:
    """None if ``name`` is quantized, else the reason it stays in bf16 (shown in the report)."""
    if not name.endswith(".weight") or ndim != 2:
        return "not a linear weight"
    kind = module_kind(name)
    if kind in ("embedding", "norm", "router", "other"):
        return f"{kind} stays bf16"
    module = name[: -len(".weight")]
    for pattern in skip:
        if pattern and pattern in module:
            return f"quant.skip '{pattern}'"
    if modules == "experts" and kind != "experts":
        return "quant.modules: experts"
    return None


def linear_module(name: str) -> str:
    """The module path of a weight or quantization tensor name (``a.b.q_proj.weight_scale`` -> ``a.b.q_proj``)."""
    head, _, tail = name.rpartition(".")
    if tail.startswith("weight") or tail in ("bias", "absmax", "quant_map", "nested_absmax", "nested_quant_map"):
        if head.endswith(".weight"):  # bnb sidecars: W.weight.absmax, W.weight.quant_state.x
            return head[: -len(".weight")]
        return head
    if ".weight.quant_state." in name:
        return name.split(".weight.quant_state.")[0]
    return head
