"""Engine rollout files in both OpenAI shapes, resolved to the demo char tokenizer's ids, and malformed ones."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orbitctl.align.rollouts import read_rollouts, resolve_ids
from orbitctl.errors import EXIT_BAD_INPUT, InputFileError
from orbitctl.model.charset import VOCAB, build_char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def test_completions_shape_reads_every_choice_of_every_line():
    got = read_rollouts(FIXTURES / "completions.jsonl")
    assert [(c.line, c.choice, c.shape) for c in got] == [(1, 0, "completions"), (1, 1, "completions"),
                                                          (3, 0, "completions")]
    first, second, third = got
    assert first.prompt_text == "2+2=" and first.prompt_token_ids is None and first.prompt_messages is None
    assert first.tokens == ["4", ""] and first.logprobs == [-0.02, -0.1] and first.token_ids is None
    assert first.top[0] == [("4", -0.02), ("5", -4.1), ("3", -5.0)]
    assert first.text == "4" and first.finish_reason == "stop"
    assert second.tokens == ["5"] and second.finish_reason == "length"
    # the response wrapped under "response", ids instead of text, a null top-K entry
    assert third.prompt_text is None and third.prompt_token_ids == [1, 7, 18, 7, 19]
    assert third.top == [[]]


def test_completions_resolve_to_tokenizer_ids(tokenizer):
    resolved = resolve_ids(read_rollouts(FIXTURES / "completions.jsonl"), tokenizer)
    first, second, third = resolved
    # a text prompt is tokenised as the policy tokenises prompts: BOS + characters
    assert first.prompt_ids == tokenizer(["2+2="])["input_ids"][0] == [VOCAB["<s>"]] + ids("2+2=")
    # the empty last token of a stopped choice is EOS
    assert first.completion_ids == [VOCAB["4"], tokenizer.eos_token_id]
    assert first.sampled_logp == [-0.02, -0.1]
    assert first.top_ids == [ids("453"), [VOCAB["</s>"], VOCAB[" "]]]
    assert first.top_logp == [[-0.02, -4.1, -5.0], [-0.1, -2.5]]
    assert first.notes == []
    assert second.completion_ids == ids("5") and second.prompt_ids == first.prompt_ids
    assert third.prompt_ids == [1, 7, 18, 7, 19] and third.completion_ids == ids("9")
    assert third.top_ids == [[]] and third.top_logp == [[]]


def test_chat_shape_with_bytes_and_token_id_placeholders(tokenizer):
    got = read_rollouts(FIXTURES / "chat.jsonl")
    assert [c.shape for c in got] == ["chat", "chat"]
    assert got[0].prompt_messages == [{"role": "user", "content": "2+2="}]
    assert got[0].token_bytes == [[52], [32]] and got[0].text == "4 "
    assert got[1].token_ids == [13, 2]  # the choice's token_ids
    assert got[1].top[0] == [(13, -0.25), (12, -1.6)]  # "token_id:N" read as ids
    first, second = resolve_ids(got, tokenizer)
    assert first.prompt_ids == [1] + ids("2+2=")
    assert first.completion_ids == ids("4 ")
    assert first.top_ids == [ids("45"), ids(" \n.")]
    assert first.top_logp[1] == [-0.7, -1.0, -9999.0]
    assert first.notes == []
    assert second.prompt_ids == [1, 7, 18, 7, 19] and second.completion_ids == [13, 2]
    assert second.top_ids == [[13, 12], []] and second.notes == []


def test_token_id_strings_without_a_token_ids_list(tmp_path, tokenizer):
    line = {"prompt_token_ids": [1, 6], "choices": [{"text": "7x", "logprobs": {
        "tokens": ["token_id:11", "token_id:30"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"token_id:11": -0.5, "token_id:4": -1.5}, {"token_id:30": -0.25}]}}]}
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (got,) = read_rollouts(path)
    assert got.token_ids == [11, 30]
    (resolved,) = resolve_ids([got], tokenizer)
    assert resolved.completion_ids == [11, 30] and resolved.top_ids == [[11, 4], [30]]
    assert resolved.notes == []  # decodes to "7x", the choice's text


def test_token_id_outside_the_vocabulary_is_refused(tmp_path, tokenizer):
    line = {"prompt_token_ids": [1], "choices": [{"logprobs": {
        "tokens": ["token_id:4"], "token_logprobs": [-0.5],
        "top_logprobs": [{"token_id:4": -0.5, "token_id:100": -2}]}}]}
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(InputFileError, match=r":1: token id 100 is outside the tokenizer's vocabulary of 100 "
                                             r"\(choices\[0\]\) — fix: verify with the tokenizer"):
        resolve_ids(read_rollouts(path), tokenizer)


def test_decode_mismatch_and_inconsistent_logprob_are_noted(tmp_path, tokenizer):
    line = {"prompt": "1+1=", "choices": [{"text": "3", "logprobs": {
        "tokens": ["2"], "token_logprobs": [-0.5], "top_logprobs": [{"2": -0.9}]}}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (resolved,) = resolve_ids(read_rollouts(path), tokenizer)
    assert len(resolved.notes) == 2
    assert "differs from the engine's text at character 0" in resolved.notes[0]
    assert "-0.5 differs from its top-K entry -0.9" in resolved.notes[1]


def test_chat_without_ids_needs_a_chat_template(tmp_path, tokenizer):
    line = {"messages": [{"role": "user", "content": "hi"}], "choices": [{"message": {"content": "4"},
            "logprobs": {"content": [{"token": "4", "logprob": -0.1, "top_logprobs": []}]}}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(InputFileError, match=rf"^{re.escape(str(path))}:1: a chat rollout, but the tokenizer has "
                                             r"no chat template \(messages\) — fix: send prompt_token_ids"):
        resolve_ids(read_rollouts(path), tokenizer)


def test_chat_template_renders_the_prompt(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")
    line = {"messages": [{"role": "user", "content": "2+2="}], "choices": [{"logprobs": {
        "content": [{"token": "4", "logprob": -0.1, "top_logprobs": []}]}}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (resolved,) = resolve_ids(read_rollouts(path), tok)
    assert resolved.prompt_ids == ids("2+2=\nA:")  # no BOS added on top of the rendered template


def test_unknown_token_is_one_clear_line(tmp_path, tokenizer):
    line = {"prompt": "a", "choices": [{"logprobs": {"tokens": ["4", "ab"], "token_logprobs": [-1.0, -2.0]}}]}
    path = tmp_path / "r.jsonl"
    path.write_text("\n" + json.dumps(line) + "\n")
    with pytest.raises(InputFileError) as info:
        resolve_ids(read_rollouts(path), tokenizer)
    message = info.value.render()
    assert message.startswith(f"{path}:2: token 'ab' maps to no id of the tokenizer "
                              f"(choices[0].logprobs.tokens[1]) — fix: start vLLM with --return-tokens-as-token-ids")
    assert "\n" not in message and info.value.exit_code == EXIT_BAD_INPUT


def test_ambiguous_token_string_is_refused_and_vocabulary_names_resolve(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # "A" decodes to "a" too: the string "a" names two ids, the vocabulary name "A" names one
    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1, "A": 2, "b": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.Replace("A", "a")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    path = tmp_path / "r.jsonl"
    good = {"prompt_token_ids": [3], "choices": [{"logprobs": {"tokens": ["A", "b"], "token_logprobs": [-1, -2]}}]}
    bad = {"prompt_token_ids": [3], "choices": [{"logprobs": {"tokens": ["b", "a"], "token_logprobs": [-1, -2]}}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    completions = read_rollouts(path)
    assert resolve_ids(completions[:1], tok)[0].completion_ids == [2, 3]
    with pytest.raises(InputFileError, match=rf"{re.escape(str(path))}:2: token 'a' maps to 2 ids \(1, 2\) "
                                             r"\(choices\[0\]\.logprobs\.tokens\[1\]\)"):
        resolve_ids(completions, tok)


def test_sentencepiece_tokens_resolve_as_an_incremental_detokenizer_prints_them(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # alone, "▁hello" and "hello" both decode to "hello"; after another token the first reads " hello"
    vocab = {"<unk>": 0, "</s>": 1, "▁hello": 2, "hello": 3, "▁world": 4, "a": 5, "▁a": 6}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="</s>")
    line = {"prompt_token_ids": [4], "choices": [{"finish_reason": "stop", "logprobs": {
        "tokens": [" hello", "hello", "▁world", ""], "token_logprobs": [-1.0, -1.0, -1.0, -1.0],
        "top_logprobs": [{" hello": -1.0, "hello": -2.0}, None, None, None]}}]}
    path = tmp_path / "sp.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (resolved,) = resolve_ids(read_rollouts(path), tok)
    assert resolved.completion_ids == [2, 3, 4, 1]  # "▁world" by its vocabulary name; "" at a stop is EOS
    assert resolved.top_ids[0] == [2, 3]


def test_bytes_resolve_before_the_token_string(tmp_path, tokenizer):
    entry = {"token": "<odd name>", "logprob": -0.5, "bytes": [55],
             "top_logprobs": [{"token": "<odd name>", "logprob": -0.5, "bytes": [55]}, {"token": "8", "logprob": -1.0}]}
    line = {"prompt_token_ids": [1], "choices": [{"message": {"content": "7"}, "logprobs": {"content": [entry]}}]}
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (resolved,) = resolve_ids(read_rollouts(path), tokenizer)
    assert resolved.completion_ids == ids("7") and resolved.top_ids == [ids("78")] and resolved.notes == []


GOOD_LOGPROBS = {"tokens": ["4"], "token_logprobs": [-0.1], "top_logprobs": [{"4": -0.1}]}
MALFORMED = [
    ("{not json", r"not JSON \(.*\) — fix: write one JSON object per line"),
    ("[1, 2]", r"a JSON list, not an object"),
    (json.dumps({"prompt": "x", "choices": []}), r"no choices \(choices\) — fix: store the engine's whole response"),
    (json.dumps({"prompt": "x", "response": {"id": 1}}), r"no choices \(response\.choices\)"),
    (json.dumps({"prompt": "x", "choices": [{"text": "4"}]}),
     r"logprobs missing \(choices\[0\]\.logprobs\) — fix: request with logprobs"),
    (json.dumps({"prompt": "x", "choices": [{"text": "4", "logprobs": None}]}), r"logprobs missing"),
    (json.dumps({"prompt": "x", "choices": [{"logprobs": {"tokens": ["4", "5"], "token_logprobs": [-0.1]}}]}),
     r"2 tokens but 1 token_logprobs \(choices\[0\]\.logprobs\.token_logprobs\)"),
    (json.dumps({"prompt": "x", "choices": [{"logprobs": {"tokens": ["4"], "token_logprobs": [0.5]}}]}),
     r"logprob 0\.5 > 0 is not a log-probability \(choices\[0\]\.logprobs\.token_logprobs\[0\]\)"),
    ('{"prompt": "x", "choices": [{"logprobs": {"tokens": ["4"], "token_logprobs": [NaN]}}]}',
     r"sampled-token logprob nan is not a finite number"),
    ('{"prompt": "x", "choices": [{"logprobs": {"tokens": ["4"], "token_logprobs": [-Infinity]}}]}',
     r"sampled-token logprob -inf is not a finite number"),
    (json.dumps({"prompt": "x", "choices": [{"logprobs": {"tokens": ["x", "4"], "token_logprobs": [None, -1.0]}}]}),
     r"logprob is null \(an echo response holds the prompt's tokens\)"),
    (json.dumps({"prompt": "x", "choices": [{"logprobs": {"content": [{"token": "4", "top_logprobs": []}]}}]}),
     r"logprob missing \(choices\[0\]\.logprobs\.content\[0\]\.logprob\)"),
    (json.dumps({"prompt": "x", "choices": [{"logprobs": {"content": [
        {"token": "4", "logprob": -0.1, "top_logprobs": [{"token": "5", "logprob": 2.0}]}]}}]}),
     r"top logprob 2\.0 is not a log-probability .*content\[0\]\.top_logprobs\[0\]"),
    (json.dumps({"prompt_token_ids": [1, -2], "choices": [{"logprobs": GOOD_LOGPROBS}]}),
     r"not a list of token ids \(integers >= 0\) \(prompt_token_ids\)"),
    (json.dumps({"choices": [{"logprobs": GOOD_LOGPROBS}]}), r"no prompt \(prompt \| messages \| prompt_token_ids\)"),
    (json.dumps({"prompt": "x", "choices": [{"token_ids": [4, 5], "logprobs": GOOD_LOGPROBS}]}),
     r"2 token_ids but 1 tokens \(choices\[0\]\.token_ids\)"),
]


@pytest.mark.parametrize("text, pattern", MALFORMED)
def test_malformed_line_is_one_line_with_file_line_key_and_fix(tmp_path, text, pattern):
    path = tmp_path / "bad.jsonl"
    ok = json.dumps({"prompt": "x", "choices": [{"logprobs": GOOD_LOGPROBS}]})
    path.write_text(ok + "\n" + text + "\n")
    with pytest.raises(InputFileError) as info:
        read_rollouts(path)
    message = info.value.render()
    assert message.startswith(f"{path}:2: ") and re.search(pattern, message), message
    assert "— fix: " in message and "\n" not in message
    assert info.value.exit_code == EXIT_BAD_INPUT


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(InputFileError, match=r"nope\.jsonl: no such rollouts file — fix: pass the JSONL file"):
        read_rollouts(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(InputFileError, match=r"empty\.jsonl: empty file, no rollouts — fix: write one JSON object"):
        read_rollouts(empty)


def test_readers_do_not_import_torch_at_module_level():
    code = ("import sys, orbitctl.align.rollouts, orbitctl.align.dumps, orbitctl.align.trends; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
