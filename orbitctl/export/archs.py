"""The architectures written to GGUF, as llama.cpp's own converter (convert_hf_to_gguf.py) writes them.

llama, qwen2 and qwen3 share one decoder layout (RMSNorm, rotary attention with grouped KV heads,
gated SiLU MLP); their tensor names come from gguf-py's per-architecture map
(``gguf.get_tensor_name_map``: ``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``).
llama.cpp's ``llama`` architecture applies rotary embeddings to interleaved pairs of a head's
dimensions where Hugging Face's llama rotates the two halves, so its converter reorders the rows of
``q_proj`` and ``k_proj`` (``LlamaModel.permute``); the same row order applies to every tensor
indexed by those rows (the INT4 codes and scales, a bias, a LoRA B). qwen2 and qwen3 use llama.cpp's
NeoX rotary, the halves, and keep Hugging Face's order. Anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from orbitctl.errors import UserError


@dataclass(frozen=True)
class Arch:
    model_type: str
    gguf_arch: str
    """``general.architecture`` (a ``gguf.MODEL_ARCH_NAMES`` value)."""
    permute_qk: bool


ARCHS = {"llama": Arch("llama", "llama", True), "qwen2": Arch("qwen2", "qwen2", False),
         "qwen3": Arch("qwen3", "qwen3", False)}
ROPE_TYPES = ("default", "linear")


def arch_for(config: dict, where: str) -> Arch:
    """The GGUF architecture of a Hugging Face config, or a UserError naming the one it is."""
    model_type = config.get("model_type")
    arch = ARCHS.get(model_type)
    if arch is None:
        raise UserError(f"{where}: architecture '{model_type}' cannot be exported to GGUF",
                        fix=f"--format gguf supports {', '.join(ARCHS)}; use --format hf-merged for other models")
    rope = rope_parameters(config)
    if (rope.get("rope_type") or "default") not in ROPE_TYPES:
        raise UserError(f"{where}: rope_type '{rope.get('rope_type')}' is not written to GGUF by orbitctl",
                        fix=f"--format gguf supports rope_type {', '.join(ROPE_TYPES)}; use --format hf-merged")
    return arch


def rope_parameters(config: dict) -> dict:
    """transformers 5's ``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling``."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        return dict(rope.get("full_attention", rope))
    return {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {})}


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


class Namer:
    """Hugging Face tensor names -> GGUF names of one architecture."""

    def __init__(self, arch: Arch, config: dict) -> None:
        import gguf

        by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        self.arch = arch
        self.config = config
        self.map = gguf.get_tensor_name_map(by_name[arch.gguf_arch], int(config["num_hidden_layers"]))

    def gguf_name(self, hf_name: str) -> str | None:
        return self.map.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def row_order(self, hf_name: str, rows: int):
        """The row permutation llama.cpp's converter applies to this tensor (a LongTensor), or None."""
        if not self.arch.permute_qk:
            return None
        module = hf_name.rsplit(".", 1)[0]
        n_head = int(self.config["num_attention_heads"])
        n_kv = int(self.config.get("num_key_value_heads") or n_head)
        if module.endswith("q_proj"):
            return _permuted_rows(rows, n_head)
        if module.endswith("k_proj"):
            return _permuted_rows(rows, n_kv)
        return None


def _permuted_rows(rows: int, heads: int):
    """``LlamaModel.permute`` of convert_hf_to_gguf.py as a row index: new row i is old row index[i]."""
    import torch

    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def write_hparams(writer, config: dict, arch: Arch) -> None:
    """The ``<arch>.*`` keys llama.cpp reads for this layout (TextModel.set_gguf_parameters, LlamaModel's)."""
    import gguf

    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    rope = rope_parameters(config)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps") or 1e-6))
    if config.get("head_dim"):
        writer.add_key_length(int(config["head_dim"]))
        writer.add_value_length(int(config["head_dim"]))
    if arch.model_type == "llama":
        writer.add_vocab_size(int(config["vocab_size"]))
        writer.add_rope_dimension_count(head_dim(config))
