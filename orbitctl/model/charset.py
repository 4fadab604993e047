"""A character-level tokenizer for the tiny demo models, in Hugging Face format.

Every character is one token: the four special tokens, newline and the 95 printable ASCII
characters, so any plain-ASCII task (JSONL prompts in words, code, math) reads without
``<unk>``; 100 entries in all (``vocab_size`` pads it with placeholder tokens ``<x100>``, ``<x101>``, ...,
like a real tokenizer's reserved tokens, for a model whose output layer should be as wide as a real
one's: text never encodes to them, sampled ones decode to their names). It is built with
the ``tokenizers`` library and saved as ``tokenizer.json`` so that
``AutoTokenizer.from_pretrained(dir)`` loads it like any other checkpoint's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3: pad/bos/eos match tiny-llama's config
CHARS = tuple("0123456789") + tuple(" S+-*=:#?,./()RMx\n")
# the built-in tasks' characters keep their historical ids 4..31; the rest of printable ASCII follows
CHARS += tuple(c for c in map(chr, range(32, 127)) if c not in CHARS)
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
VOCAB_SIZE = len(VOCAB)  # 100


def build_char_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A PreTrainedTokenizerFast: one token per character, BOS prepended, left padding; ``vocab_size`` entries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size}: the characters alone take {VOCAB_SIZE} ids")
    vocab = {**VOCAB, **{f"<x{i}>": i for i in range(VOCAB_SIZE, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, VOCAB[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False)


def save_char_tokenizer(directory: str | Path, vocab_size: int = VOCAB_SIZE) -> None:
    build_char_tokenizer(vocab_size).save_pretrained(str(directory))
