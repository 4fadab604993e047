"""The demo's character tokenizer, and the same padded to a real model's vocabulary width."""

import pytest

pytest.importorskip("tokenizers")


def test_padded_vocabulary_keeps_the_characters_and_decodes_the_placeholders():
    from orbitctl.model.charset import VOCAB, VOCAB_SIZE, build_char_tokenizer

    plain, wide = build_char_tokenizer(), build_char_tokenizer(8192)
    assert len(plain) == VOCAB_SIZE == 100 and len(wide) == 8192
    text = "What is 12 plus 7? <x150>"
    # the same ids for every text: placeholders are never produced by encoding, only by sampling
    assert wide(text)["input_ids"] == plain(text)["input_ids"]
    assert max(wide(text)["input_ids"]) < VOCAB_SIZE
    assert wide.decode([VOCAB["7"], 100, 8191, VOCAB["</s>"]], skip_special_tokens=True) == "7<x100><x8191>"


def test_a_vocabulary_narrower_than_the_characters_is_refused():
    from orbitctl.model.charset import build_char_tokenizer

    with pytest.raises(ValueError, match="100"):
        build_char_tokenizer(64)
