"""SGLang's native /generate lines and streamed SSE rollouts read as their unstreamed lines, and malformed ones."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest

from orbitctl.align.rollouts import read_rollouts, resolve_ids
from orbitctl.cli.app import main
from orbitctl.errors import EXIT_BAD_INPUT, InputFileError
from orbitctl.model.charset import VOCAB, build_char_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
DONE = "data: [DONE]\n\n"


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def _lines(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines() if raw.strip()]


def _sse(events: list[dict]) -> str:
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events) + DONE


def _unplaced(completions) -> list:
    return [dataclasses.replace(c, line=0, path="") for c in completions]


def test_generate_lines_give_logprobs_ids_and_top_k():
    got = read_rollouts(FIXTURES / "sglang_generate.jsonl")
    assert [(c.line, c.choice, c.shape) for c in got] == [(1, 0, "sglang"), (2, 0, "sglang"), (3, 0, "sglang"),
                                                          (3, 1, "sglang")]
    first, second, third, fourth = got
    # the request's "text" is the prompt; the response's "text" is the completion
    assert first.prompt_text == "2+2=" and first.prompt_token_ids is None and first.text == "4 "
    assert first.token_ids == ids("4 ") and first.tokens == ["4", " "] and first.logprobs == [-0.05, -0.7]
    assert first.top == [[(VOCAB["4"], -0.05), (VOCAB["5"], -3.2)], [(VOCAB[" "], -0.7), (VOCAB["</s>"], -1.0)]]
    assert first.finish_reason == "length"
    # merged at the top level with input_ids; return_text_in_logprobs false leaves the text slot null
    assert second.prompt_token_ids == [1, 7, 18, 7, 19] and second.token_ids == [13, 2]
    assert second.tokens == ["", ""] and second.top == [[(13, -0.25), (12, -1.6)], []]
    assert second.finish_reason == "stop" and second.text == "9"
    # a batch: one prompt of the request's input_ids per response
    assert third.prompt_token_ids == [1, 6, 16, 6, 19] and fourth.prompt_token_ids == [1, 7, 18, 7, 19]
    assert third.token_ids == ids("4") and fourth.token_ids == ids("9") and fourth.logprobs == [-0.3]
    resolved = resolve_ids(got, build_char_tokenizer())
    assert resolved[0].prompt_ids == [VOCAB["<s>"]] + ids("2+2=") and resolved[0].completion_ids == ids("4 ")
    assert resolved[0].top_ids == [ids("45"), [VOCAB[" "], VOCAB["</s>"]]] and resolved[0].notes == []
    assert resolved[1].completion_ids == [13, 2] and resolved[1].top_logp == [[-0.25, -1.6], []]
    assert resolved[1].notes == []  # "9" then EOS decodes to the engine's text


def _completions_chunks(response: dict) -> list[dict]:
    """vLLM's /v1/completions stream of ``response``: one token per choice per chunk, then a usage chunk."""
    chunks = []  # (position, chunk): sorted by position, the choices' chunks interleave
    for choice in response["choices"]:
        logprobs = choice["logprobs"]
        for j, token in enumerate(logprobs["tokens"]):
            last = j == len(logprobs["tokens"]) - 1
            chunks.append((j, {"object": "text_completion", "choices": [{
                "index": choice["index"], "text": choice["text"] if j == 0 else "",
                "finish_reason": choice["finish_reason"] if last else None,
                "logprobs": {"tokens": [token], "token_logprobs": [logprobs["token_logprobs"][j]],
                             "top_logprobs": [logprobs["top_logprobs"][j]],
                             "text_offset": [logprobs["text_offset"][j]]}}]}))
    chunks.sort(key=lambda item: item[0])
    return [chunk for _, chunk in chunks] + [{"choices": [], "usage": {"completion_tokens": 3}}]


def _chat_chunks(response: dict) -> list[dict]:
    choice = response["choices"][0]
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}]}]
    content = choice["logprobs"]["content"]
    for j, entry in enumerate(content):
        chunks.append({"choices": [{"index": 0, "delta": {"content": entry["token"]}, "logprobs": {"content": [entry]},
                                    "finish_reason": choice["finish_reason"] if j == len(content) - 1 else None}]})
    return chunks


def test_openai_streams_read_as_the_unstreamed_lines(tmp_path):
    completions, chat = _lines(FIXTURES / "completions.jsonl")[0], _lines(FIXTURES / "chat.jsonl")[0]
    stream = tmp_path / "stream.sse"
    request = {"prompt": completions["prompt"]}
    chat_request = {"messages": chat["messages"], "prompt_token_ids": chat["prompt_token_ids"]}
    stream.write_text(json.dumps(request) + "\n" + _sse(_completions_chunks(completions)) +
                      json.dumps(chat_request) + "\n" + _sse(_chat_chunks(chat)))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps(completions) + "\n" + json.dumps(chat) + "\n")
    streamed = read_rollouts(stream)
    # each stream starts at its first data: line: 4 events and [DONE], each with its blank line, then a request
    assert [c.line for c in streamed] == [2, 2, 2 + 2 * 5 + 1]
    assert _unplaced(streamed) == _unplaced(read_rollouts(plain))
    assert streamed[0].tokens == ["4", ""] and streamed[1].finish_reason == "length"
    assert streamed[2].text == "4 " and streamed[2].token_bytes == [[52], [32]]


def _generate_events(response: dict, incremental: bool) -> list[dict]:
    """SGLang's native /generate stream of ``response``: cumulative events, or increments."""
    meta, events = response["meta_info"], []
    triples, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    for j in range(1, len(triples) + 1):
        start = j - 1 if incremental else 0
        last = j == len(triples)
        text = "".join(t[2] for t in triples[start:j]) if all(t[2] is not None for t in triples) else None
        events.append({"text": text, "meta_info": {
            **meta, "completion_tokens": j, "finish_reason": meta["finish_reason"] if last else None,
            "output_token_logprobs": triples[start:j], "output_top_logprobs": tops[start:j]}})
    return events


def _as_pairs(value):
    """Every [logprob, id, text] triple under ``value`` as a [logprob, id] pair (lmdeploy's SGLang-compatible
    server has no text slot)."""
    if isinstance(value, list) and len(value) == 3 and isinstance(value[1], int) and not isinstance(value[0], list):
        return value[:2]
    if isinstance(value, list):
        return [_as_pairs(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_pairs(v) if k in ("output_token_logprobs", "output_top_logprobs", "meta_info", "response")
                else v for k, v in value.items()}
    return value


def test_pair_shaped_generate_answers_read_with_the_same_logprobs(tmp_path):
    lines = _lines(FIXTURES / "sglang_generate.jsonl")
    pairs = [_as_pairs(line) for line in lines]
    assert pairs != lines and all(len(e) == 2 for e in pairs[0]["response"]["meta_info"]["output_token_logprobs"])
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in pairs))
    got, want = read_rollouts(path), read_rollouts(FIXTURES / "sglang_generate.jsonl")
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert (g.token_ids, g.logprobs, g.top, g.prompt_token_ids, g.prompt_text, g.finish_reason) == \
            (w.token_ids, w.logprobs, w.top, w.prompt_token_ids, w.prompt_text, w.finish_reason)
        assert g.tokens == [""] * len(g.token_ids)  # no text slot: the token text is unknown, as with null
    assert got[0].logprobs == [-0.05, -0.7] and got[0].top[0] == [(VOCAB["4"], -0.05), (VOCAB["5"], -3.2)]
    resolved = resolve_ids(got, build_char_tokenizer())
    assert resolved[0].completion_ids == ids("4 ") and resolved[0].notes == []


@pytest.mark.parametrize("incremental", [False, True])
def test_generate_streams_read_as_the_unstreamed_line(tmp_path, incremental):
    line = _lines(FIXTURES / "sglang_generate.jsonl")[0]
    request = {k: v for k, v in line.items() if k != "response"}
    events = _generate_events(line["response"], incremental)
    if not incremental:
        events.append(events[-1])  # a cumulative stream may repeat the whole response: nothing is added twice
    path = tmp_path / "generate.sse"
    path.write_text(json.dumps(request) + "\n" + _sse(events))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps(line) + "\n")
    (streamed,) = read_rollouts(path)
    assert streamed.line == 2 and _unplaced([streamed]) == _unplaced(read_rollouts(plain))


def test_incremental_generate_stream_of_a_repeated_token_is_not_read_as_cumulative(tmp_path):
    # the second event's list equals the first: completion_tokens says it is a new token, not a repeat
    triple = [-0.1, VOCAB["4"], "4"]
    events = [{"text": "4", "meta_info": {"completion_tokens": n, "output_token_logprobs": [triple],
                                          "output_top_logprobs": [[triple]]}} for n in (1, 2)]
    path = tmp_path / "repeat.sse"
    path.write_text(json.dumps({"input_ids": [1, 6]}) + "\n" + _sse(events))
    (got,) = read_rollouts(path)
    assert got.token_ids == ids("44") and got.text == "44" and got.top == [[(VOCAB["4"], -0.1)]] * 2


def _generate(meta: dict, **line) -> str:
    return json.dumps({"input_ids": [1, 6], **line, "text": "4", "meta_info": meta})


GOOD = {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 8, "4"]], "output_top_logprobs": [[[-0.1, 8, "4"]]]}
STREAM_EVENT = json.dumps({"text": "4", "meta_info": GOOD})
MALFORMED = [
    (_generate({**GOOD, "output_token_logprobs": [["-0.1", 8, "4"]]}), 1,
     r'\["-0\.1", 8, "4"\] is not a \[logprob, token_id, text \| null\] triple or a \[logprob, token_id\] pair '
     r"\(meta_info\.output_token_logprobs\[0\]\) — fix: store SGLang's meta_info unchanged"),
    (_generate({**GOOD, "output_token_logprobs": [[-0.1, 8.0, "4"]]}), 1, r"output_token_logprobs\[0\]\)"),
    (_generate({**GOOD, "output_token_logprobs": [[-0.1, 8, 4]]}), 1, r"is not a \[logprob, token_id"),
    (_generate({**GOOD, "output_top_logprobs": [[[-0.1]]]}), 1,
     r"\[-0\.1\] is not a .* or a \[logprob, token_id\] pair \(meta_info\.output_top_logprobs\[0\]\[0\]\)"),
    (_generate({**GOOD, "output_token_logprobs": [[-0.1, 8, "4", 0]]}), 1, r"is not a \[logprob, token_id"),
    (_generate({**GOOD, "output_top_logprobs": []}), 1,
     r"output_top_logprobs holds 0 positions, output_token_logprobs 1 \(meta_info\.output_top_logprobs\)"),
    (_generate({**GOOD, "output_token_logprobs": [[0.5, 8, "4"]]}), 1, r"logprob 0\.5 > 0 is not a log-probability"),
    (_generate({"completion_tokens": 1}), 1,
     r'output_token_logprobs missing \(meta_info\.output_token_logprobs\) — fix: request /generate with "return_logprob"'),
    (json.dumps({"text": "4", "meta_info": GOOD}), 1, r"no prompt \(text \| input_ids \| prompt_token_ids\)"),
    (json.dumps({"input_ids": [[1], [2], [3]], "response": [{"text": "4", "meta_info": GOOD}] * 2}), 1,
     r"3 prompts for 2 responses \(text \| input_ids\)"),
    (json.dumps({"text": "x"}), 1, r"a request without a response \(choices \| meta_info \| response\)"),
    (json.dumps({"text": "x"}) + "\n" + f"data: {STREAM_EVENT}\n\n", 2,
     r"the stream from line 2 has no data: \[DONE\] line — fix: save the server's whole stream"),
    (json.dumps({"text": "x"}) + "\n" + f"data: {STREAM_EVENT}\n" + _generate(GOOD), 2,
     r"the stream has no data: \[DONE\] line"),
    (json.dumps({"text": "x"}) + "\n" + f"data: {STREAM_EVENT}\n\ndata: {{oops\n\n" + DONE, 4,
     r"not JSON \(.*\) — fix: save the server's whole stream"),
    (json.dumps({"text": "x"}) + "\n" + _sse([{"text": "4", "meta_info": GOOD}, {"choices": []}]), 2,
     r"a stream mixing SGLang /generate events and OpenAI chunks"),
    (json.dumps({"text": "x"}) + "\n" + _sse([{"text": "4", "meta_info": {**GOOD, "completion_tokens": 3}}]), 2,
     r"1 output_token_logprobs after 0 streamed: neither all of completion_tokens \(3\)"),
    (json.dumps({"text": "x"}) + "\n" + _sse([{"object": "text_completion"}]), 2,
     r"a stream chunk without choices \(choices\)"),
    (DONE, 1, r"data: \[DONE\] without a stream before it"),
]


@pytest.mark.parametrize("text, line, pattern", MALFORMED)
def test_malformed_is_one_line_with_file_line_key_and_fix(tmp_path, text, line, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(InputFileError) as info:
        read_rollouts(path)
    message = info.value.render()
    assert message.startswith(f"{path}:{line}: ") and re.search(pattern, message), message
    assert "— fix: " in message and "\n" not in message and info.value.exit_code == EXIT_BAD_INPUT


def test_ids_outside_the_vocabulary_are_refused_when_resolved(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(_generate({**GOOD, "output_top_logprobs": [[[-0.1, 8, None], [-2.0, 100, None]]]}) + "\n")
    with pytest.raises(InputFileError, match=r":1: token id 100 is outside the tokenizer's vocabulary of 100 "
                                             r"\(meta_info\) — fix: verify with the tokenizer"):
        resolve_ids(read_rollouts(path), build_char_tokenizer())


@pytest.mark.parametrize("case", [1, 12, 14])
def test_cli_prints_one_error_line_and_exits_2(tmp_path, capsys, align_profile, one_error_line, case):
    text, line, _ = MALFORMED[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    profile, _ = align_profile()
    code = main(["verify-alignment", str(profile), "--rollouts", str(path)])
    assert code == EXIT_BAD_INPUT
    one_error_line(capsys.readouterr().err, f"{path}:{line}: ", "fix: ")


def _as_generate(line: dict) -> tuple[dict, dict]:
    """An OpenAI completions line written with token_id:N tokens, as SGLang's /generate request and response."""
    logprobs = line["choices"][0]["logprobs"]

    def triple(token: str, value: float) -> list:
        return [value, int(token.removeprefix("token_id:")), None]

    triples = [triple(t, v) for t, v in zip(logprobs["tokens"], logprobs["token_logprobs"])]
    tops = [[triple(t, v) for t, v in row.items()] for row in logprobs["top_logprobs"]]
    meta = {"finish_reason": {"type": "length", "length": len(triples)}, "prompt_tokens": len(line["prompt_token_ids"]),
            "completion_tokens": len(triples), "output_token_logprobs": triples, "output_top_logprobs": tops}
    return {"input_ids": line["prompt_token_ids"], "return_logprob": True, "top_logprobs_num": 5}, {"meta_info": meta}


@pytest.mark.slow
def test_verify_alignment_passes_on_generate_lines_from_the_models_own_infer_path(align_profile, tmp_path, capsys):
    # the OpenAI-shaped lines test_verify.py samples from the tiny model, rewritten in SGLang's layout
    spec = importlib.util.spec_from_file_location("align_test_verify", Path(__file__).with_name("test_verify.py"))
    test_verify = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_verify)
    path, profile = align_profile()
    openai = tmp_path / "openai.jsonl"
    test_verify._engine_rollouts(profile, openai, "completions")
    out = []
    for i, line in enumerate(_lines(openai)):
        request, response = _as_generate(line)
        if i % 2:  # half the prompts as incremental /generate streams
            out.append(json.dumps(request) + "\n" + _sse(_generate_events(response, True)))
        else:
            out.append(json.dumps({**request, "response": response}) + "\n")
    rollouts = tmp_path / "sglang.jsonl"
    rollouts.write_text("".join(out))
    assert [c.token_ids for c in read_rollouts(rollouts)] == [c.token_ids for c in read_rollouts(openai)]
    capsys.readouterr()  # what sampling the lines printed is not the command's output
    code = main(["verify-alignment", str(path), "--rollouts", str(rollouts), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads(captured.out)
    assert doc["verdict"] == "PASS" and doc["source"]["source"] == "rollouts"
    assert doc["source"]["completions"] == 8 and doc["source"]["engine_top_k"] == 5
