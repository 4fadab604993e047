"""Hugging Face config.json dict -> ArchSpec, one builder per attention/MLP family.

Shapes follow the checkpoints (and transformers' modules) of each model type, so the counts
equal the real ``numel`` sum; routed experts are listed per projection and stacked over the
expert count.
"""

from __future__ import annotations

from orbitctl.arch.spec import (
    ATTENTION, BIAS, EMBEDDING, EXPERT, LM_HEAD, MLP, NORM, ROUTER, SHARED_EXPERT, ArchSpec, Layer, Weight,
)
from orbitctl.errors import UserError

GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MLA_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED = GQA_TYPES + MLA_TYPES


def tied_embeddings(config: dict) -> bool:
    """Whether the model's output layer is its input embedding (``tie_word_embeddings``; unset means untied,
    as for every model type parsed here). A tied checkpoint stores one matrix, ``embed_tokens``."""
    if "text_config" in config and "hidden_size" not in config:
        config = config["text_config"]
    return bool(config.get("tie_word_embeddings", False))


def arch_from_config(config: dict, name: str = "custom", source: str = "config.json") -> ArchSpec:
    """Parse a config.json dict; unknown model types and missing keys are a UserError naming the key."""
    if "text_config" in config and "hidden_size" not in config:
        config = config["text_config"]  # multimodal wrappers (e.g. Kimi-K2.5) carry the LM here
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED:
        raise UserError(f"{source}: model_type: '{model_type}' is not supported",
                        fix=f"supported model types: {', '.join(SUPPORTED)}")
    reader = _Reader(config, source)
    if model_type in MLA_TYPES:
        return _build(reader, name, model_type, mla=True)
    return _build(reader, name, model_type, mla=False)


class _Reader:
    def __init__(self, config: dict, source: str) -> None:
        self.config, self.source = config, source

    def int(self, key: str, default: int | None = None) -> int:
        value = self.config.get(key, default)
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{self.source}: {key}: expected a non-negative integer (got {value!r})",
                            fix="use the model's published config.json")
        return value

    def opt_int(self, key: str) -> int | None:
        return None if self.config.get(key) is None else self.int(key)

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.config.get(key, default))


def _linear(name: str, kind: str, out_f: int, in_f: int, copies: int = 1) -> Weight:
    return Weight(name, kind, (out_f, in_f), copies=copies, linear=True)


def _swiglu(prefix: str, kind: str, width: int, hidden: int, copies: int = 1, bias: bool = False) -> list[Weight]:
    weights = [
        _linear(f"{prefix}.gate_proj", kind, width, hidden, copies),
        _linear(f"{prefix}.up_proj", kind, width, hidden, copies),
        _linear(f"{prefix}.down_proj", kind, hidden, width, copies),
    ]
    if bias:
        weights += [Weight(f"{prefix}.gate_proj.bias", BIAS, (width,)), Weight(f"{prefix}.up_proj.bias", BIAS, (width,)),
                    Weight(f"{prefix}.down_proj.bias", BIAS, (hidden,))]
    return weights


def _gqa_attention(r: _Reader, model_type: str, h: int, a: int, g: int, d: int) -> list[Weight]:
    p = "self_attn"
    weights = [_linear(f"{p}.q_proj", ATTENTION, a * d, h), _linear(f"{p}.k_proj", ATTENTION, g * d, h),
               _linear(f"{p}.v_proj", ATTENTION, g * d, h), _linear(f"{p}.o_proj", ATTENTION, h, a * d)]
    if model_type == "qwen2":  # Qwen2 always has q/k/v biases and never an o_proj bias
        biased = {"q_proj": a * d, "k_proj": g * d, "v_proj": g * d}
    elif model_type in ("llama", "qwen3", "qwen3_moe") and r.flag("attention_bias"):
        biased = {"q_proj": a * d, "k_proj": g * d, "v_proj": g * d, "o_proj": h}
    else:
        biased = {}
    weights += [Weight(f"{p}.{n}.bias", BIAS, (size,)) for n, size in biased.items()]
    if model_type in ("qwen3", "qwen3_moe"):
        weights += [Weight(f"{p}.q_norm", NORM, (d,)), Weight(f"{p}.k_norm", NORM, (d,))]
    return weights


def _mla_attention(r: _Reader, h: int, a: int) -> tuple[list[Weight], dict]:
    q_lora = r.opt_int("q_lora_rank")
    kv_lora, rope = r.int("kv_lora_rank"), r.int("qk_rope_head_dim")
    nope, v_dim = r.int("qk_nope_head_dim"), r.int("v_head_dim")
    bias = r.flag("attention_bias")
    p = "self_attn"
    qk = nope + rope
    weights: list[Weight] = []
    if q_lora:
        weights += [_linear(f"{p}.q_a_proj", ATTENTION, q_lora, h), Weight(f"{p}.q_a_layernorm", NORM, (q_lora,)),
                    _linear(f"{p}.q_b_proj", ATTENTION, a * qk, q_lora)]
        if bias:
            weights.append(Weight(f"{p}.q_a_proj.bias", BIAS, (q_lora,)))
    else:
        weights.append(_linear(f"{p}.q_proj", ATTENTION, a * qk, h))
    weights += [_linear(f"{p}.kv_a_proj_with_mqa", ATTENTION, kv_lora + rope, h),
                Weight(f"{p}.kv_a_layernorm", NORM, (kv_lora,)),
                _linear(f"{p}.kv_b_proj", ATTENTION, a * (nope + v_dim), kv_lora),
                _linear(f"{p}.o_proj", ATTENTION, h, a * v_dim)]
    if bias:
        weights += [Weight(f"{p}.kv_a_proj_with_mqa.bias", BIAS, (kv_lora + rope,)), Weight(f"{p}.o_proj.bias", BIAS, (h,))]
    dims = dict(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
                v_head_dim=v_dim)
    return weights, dims


def _moe_plan(r: _Reader, model_type: str, num_layers: int) -> tuple[list[bool], dict]:
    """Which layers are MoE, and the expert dimensions."""
    if model_type == "mixtral":
        e, k = r.int("num_local_experts"), r.int("num_experts_per_tok")
        return [True] * num_layers, dict(num_experts=e, experts_per_token=k, moe_intermediate_size=r.int("intermediate_size"))
    if model_type == "qwen3_moe":
        e, k = r.int("num_experts"), r.int("num_experts_per_tok")
        step = max(1, r.int("decoder_sparse_step", 1))
        dense_only = set(r.config.get("mlp_only_layers") or [])
        moe = [e > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
        return moe, dict(num_experts=e, experts_per_token=k, moe_intermediate_size=r.int("moe_intermediate_size"))
    if model_type in MLA_TYPES:
        e = r.int("n_routed_experts", 0)
        first_dense, freq = r.int("first_k_dense_replace", 0), max(1, r.int("moe_layer_freq", 1))
        moe = [e > 0 and i >= first_dense and i % freq == 0 for i in range(num_layers)]
        shared = r.int("n_shared_experts", 0) * r.int("moe_intermediate_size")
        return moe, dict(num_experts=e, experts_per_token=r.int("num_experts_per_tok"),
                         moe_intermediate_size=r.int("moe_intermediate_size"), shared_intermediate_size=shared)
    return [False] * num_layers, {}


def _moe_mlp(model_type: str, h: int, dims: dict) -> list[Weight]:
    e, width = dims["num_experts"], dims["moe_intermediate_size"]
    weights = [Weight("mlp.gate", ROUTER, (e, h), linear=True,
                      dtype="fp32" if model_type in MLA_TYPES else None)]
    weights += _swiglu("mlp.experts", EXPERT, width, h, copies=e)
    if model_type in MLA_TYPES:
        # the aux-loss-free balancing bias: stored in the checkpoint, a buffer in the model
        weights.append(Weight("mlp.gate.e_score_correction_bias", ROUTER, (e,), parameter=False, dtype="fp32"))
    if dims.get("shared_intermediate_size"):
        weights += _swiglu("mlp.shared_experts", SHARED_EXPERT, dims["shared_intermediate_size"], h)
    return weights


def _build(r: _Reader, name: str, model_type: str, mla: bool) -> ArchSpec:
    h, n_layers, vocab = r.int("hidden_size"), r.int("num_hidden_layers"), r.int("vocab_size")
    a = r.int("num_attention_heads")
    g = r.int("num_key_value_heads", a) if r.config.get("num_key_value_heads") is not None else a
    head_dim = r.config.get("head_dim") or (h // a if a else 0)
    inter = r.int("intermediate_size")
    mla_dims: dict = {}
    if mla:
        attention, mla_dims = _mla_attention(r, h, a)
        head_dim = mla_dims["qk_nope_head_dim"] + mla_dims["qk_rope_head_dim"]
    else:
        attention = _gqa_attention(r, model_type, h, a, g, head_dim)
    moe_flags, moe_dims = _moe_plan(r, model_type, n_layers)
    norms = [Weight("input_layernorm", NORM, (h,)), Weight("post_attention_layernorm", NORM, (h,))]
    mlp_bias = model_type == "llama" and r.flag("mlp_bias")
    dense_layer = tuple(attention + _swiglu("mlp", MLP, inter, h, bias=mlp_bias) + norms)
    moe_layer = tuple(attention + _moe_mlp(model_type, h, moe_dims) + norms) if moe_dims else ()
    layers = tuple(Layer(i, flag, moe_layer if flag else dense_layer) for i, flag in enumerate(moe_flags))

    tie = tied_embeddings(r.config)
    mtp = r.int("num_nextn_predict_layers", 0) if mla else 0
    mtp_params = 0
    if mtp:
        # each MTP module as the checkpoint stores it: one MoE decoder layer, enorm, hnorm,
        # eh_proj (2h -> h), its head norm, and its own copies of the embedding and output head
        block = Layer(n_layers, True, moe_layer or dense_layer).params
        mtp_params = mtp * (block + 3 * h + 2 * h * h + 2 * vocab * h)
    return ArchSpec(
        name=name, model_type=model_type, hidden_size=h, vocab_size=vocab, num_layers=n_layers,
        num_heads=a, num_kv_heads=a if mla else g, head_dim=head_dim,
        attention="mla" if mla else "gqa", intermediate_size=inter, layers=layers,
        embedding=Weight("embed_tokens", EMBEDDING, (vocab, h)),
        final_norm=Weight("norm", NORM, (h,)),
        lm_head=None if tie else Weight("lm_head", LM_HEAD, (vocab, h), linear=True),
        tie_word_embeddings=tie, qk_norm=model_type in ("qwen3", "qwen3_moe"),
        mtp_layers=mtp, mtp_params=mtp_params,
        max_position_embeddings=int(r.config.get("max_position_embeddings") or 0),
        config=dict(r.config), **mla_dims, **moe_dims,
    )
