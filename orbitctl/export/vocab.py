"""The tokenizer as llama.cpp's loader reads it (``tokenizer.ggml.*``), from the base's tokenizer files.

Two kinds of Hugging Face tokenizer are written:

- a character-level ``WordLevel`` vocabulary (orbitctl's demo tokenizer: one token per character
  plus the special tokens) as llama.cpp's ``llama`` (SentencePiece) model with no merges: its
  tokenizer splits text into characters and joins pairs only where the joined string is a token,
  which no pair of characters is here, so every character stays one token, as in Hugging Face.
  SentencePiece spells a space ``▁`` (U+2581), so the space token is written that way; no space
  is prefixed to the text (``add_space_prefix`` false), as the Hugging Face tokenizer adds none.
- a byte-level ``BPE`` (Llama 3, Qwen2/Qwen3) as llama.cpp's ``gpt2`` model: the tokens in
  byte-to-unicode spelling, the merges in rank order, and the pre-tokenizer llama.cpp names for
  the family (``llama-bpe``, ``qwen2``), the names its converter writes for those tokenizers.

Token types: special added tokens are CONTROL (the unknown token UNKNOWN), other added tokens
USER_DEFINED, the rest NORMAL. The bos/eos/unk/pad ids and whether BOS/EOS are added come from the
Hugging Face tokenizer itself (what it does to a plain string). Other tokenizers are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from orbitctl.errors import UserError

SPM_SPACE = "\u2581"
BPE_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


@dataclass
class Vocab:
    """Everything ``tokenizer.ggml.*`` holds."""

    model: str
    """``llama`` (SentencePiece) or ``gpt2`` (byte-level BPE)."""
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    special: dict[str, int] = field(default_factory=dict)
    """``bos``, ``eos``, ``unk``, ``pad`` -> id, where the tokenizer has them."""
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None

    def write(self, writer) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.merges:
            writer.add_token_merges(self.merges)
        adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
                  "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
        for kind, token_id in self.special.items():
            adders[kind](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)

    def to_dict(self) -> dict:
        return {"model": self.model, "pre": self.pre, "tokens": len(self.tokens), "merges": len(self.merges),
                "special": self.special, "add_bos": self.add_bos, "add_eos": self.add_eos}


def read_vocab(directory: Path, model_type: str, vocab_size: int) -> Vocab:
    """The tokenizer in ``directory`` (tokenizer.json + tokenizer_config.json) as GGUF metadata."""
    from transformers import AutoTokenizer

    file = directory / "tokenizer.json"
    if not file.exists():
        raise UserError(f"{directory}: no tokenizer.json", fix="export needs a fast (tokenizer.json) tokenizer next to the base")
    spec = json.loads(file.read_text(encoding="utf-8"))
    hf = AutoTokenizer.from_pretrained(str(directory))
    kind = (spec.get("model") or {}).get("type")
    if kind == "WordLevel" and _is_char_level(spec):
        vocab = _char_level(spec, hf)
    elif kind == "BPE" and _is_byte_level(spec):
        vocab = _byte_level_bpe(spec, hf, model_type)
    else:
        raise UserError(f"{file}: a {kind} tokenizer is not written to GGUF by orbitctl",
                        fix="export supports a character-level WordLevel or a byte-level BPE tokenizer")
    if len(vocab.tokens) > vocab_size:
        raise UserError(f"{file}: {len(vocab.tokens)} tokens for a vocab_size of {vocab_size}",
                        fix="the tokenizer does not belong to this model")
    _pad_vocab(vocab, vocab_size)
    vocab.special = {k: v for k, v in (("bos", hf.bos_token_id), ("eos", hf.eos_token_id), ("unk", hf.unk_token_id),
                                       ("pad", hf.pad_token_id)) if v is not None}
    probe = hf("a")["input_ids"]
    vocab.add_bos = bool(probe) and hf.bos_token_id is not None and probe[0] == hf.bos_token_id
    vocab.add_eos = bool(probe) and hf.eos_token_id is not None and probe[-1] == hf.eos_token_id
    return vocab


def _added(spec: dict) -> dict[int, dict]:
    return {int(t["id"]): t for t in spec.get("added_tokens") or []}


def _is_char_level(spec: dict) -> bool:
    added = {t["content"] for t in spec.get("added_tokens") or []}
    return all(len(tok) == 1 for tok in spec["model"]["vocab"] if tok not in added)


def _is_byte_level(spec: dict) -> bool:
    def has(node) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(child) for child in node.get("pretokenizers") or node.get("processors") or [])

    return has(spec.get("pre_tokenizer"))


def _ordered(vocab: dict[str, int], added: dict[int, dict]) -> list[str]:
    by_id = {i: tok for tok, i in vocab.items()}
    by_id.update({i: t["content"] for i, t in added.items()})
    size = max(by_id) + 1
    return [by_id.get(i, f"[PAD{i}]") for i in range(size)]


def _type_of(token_id: int, added: dict[int, dict], unk: str | None, token: str) -> int:
    from gguf import TokenType

    if token == unk:
        return int(TokenType.UNKNOWN)
    if token_id in added:
        return int(TokenType.CONTROL if added[token_id].get("special") else TokenType.USER_DEFINED)
    return int(TokenType.NORMAL)


def _char_level(spec: dict, hf) -> Vocab:
    added = _added(spec)
    tokens = _ordered(spec["model"]["vocab"], added)
    if SPM_SPACE in tokens:
        raise UserError(f"the tokenizer has both ' ' and '{SPM_SPACE}' as tokens",
                        fix="a SentencePiece vocabulary spells the space as U+2581; rename one of them")
    types = [_type_of(i, added, hf.unk_token, t) for i, t in enumerate(tokens)]
    spelled = [SPM_SPACE if (t == " " and i not in added) else t for i, t in enumerate(tokens)]
    return Vocab("llama", spelled, types, scores=[0.0] * len(spelled), add_space_prefix=False)


def _byte_level_bpe(spec: dict, hf, model_type: str) -> Vocab:
    added = _added(spec)
    tokens = _ordered(spec["model"]["vocab"], added)
    types = [_type_of(i, added, hf.unk_token, t) for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges") or []]
    return Vocab("gpt2", tokens, types, merges=merges, pre=BPE_PRE.get(model_type, "default"))


def _pad_vocab(vocab: Vocab, size: int) -> None:
    """Rows of the embedding beyond the tokenizer's last id get unused placeholder tokens (as the converter does)."""
    from gguf import TokenType

    for i in range(len(vocab.tokens), size):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.types.append(int(TokenType.UNUSED))
        if vocab.scores is not None:
            vocab.scores.append(0.0)
