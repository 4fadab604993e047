"""The framing of a rollouts file: JSON lines, ``/generate`` batch lists and streamed SSE responses.

A rollouts file holds, line by line, either a JSON object (a request and its response), a JSON list
of such objects (SGLang's ``/generate`` answers a batched request with a list), or a streamed response
saved as the server sent it: ``data: {...}`` lines, blank lines between events, ending ``data: [DONE]``.
A stream's prompt is the request object on the line just before it (a JSON object without a response).

A stream is reassembled into the response the same request would have had unstreamed, so one reader
reads both:

- OpenAI-compatible chunks (vLLM, SGLang ``/v1/completions`` and ``/v1/chat/completions`` with
  ``"stream": true``) carry only the new tokens: per choice ``index``, the text, ``delta.content``,
  ``token_ids`` and the ``logprobs`` lists are concatenated in order; the last ``finish_reason`` wins.
- SGLang's native ``/generate`` events carry, by default, everything so far (``text`` and
  ``meta_info.output_token_logprobs``/``output_top_logprobs`` are cumulative: the last event is the
  whole response); a server started with ``--incremental-streaming-output`` sends only the new part.
  An event is taken as cumulative when its list begins with everything gathered so far and holds
  ``meta_info.completion_tokens`` entries, else as an increment that must bring the count to
  ``completion_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import InputFileError

DONE = "[DONE]"
RESPONSE_KEYS = ("choices", "meta_info", "response")
STREAM_FIX = "save the server's whole stream, every data: line through data: [DONE]"


@dataclass
class Record:
    """One request and its response as read from the file: ``line`` is where it starts (1-based)."""

    line: int
    obj: dict
    prefix: str = ""      # names the record inside its line in messages ("[2]." for a batch element)
    stream: bool = False  # reassembled from SSE events: the response sits under "response"


def line_error(where: str, what: str, key: str | None, fix: str) -> InputFileError:
    """The one-line error for a malformed rollouts line: ``file:line: what (key) — fix: ...``."""
    key_part = f" ({key})" if key else ""
    return InputFileError(f"{where}: {what}{key_part} — fix: {fix}")


def read_records(path: Path) -> list[Record]:
    """Every record of a rollouts file in file order; streams reassembled, batches split."""
    records: list[Record] = []
    request: Record | None = None           # a request line waiting for its stream
    stream: list[tuple[int, str]] | None = None
    start, last = 0, 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith(":"):  # blank lines part SSE events; ":" starts an SSE comment
            continue
        if text.startswith("data:"):
            payload = text[len("data:"):].strip()
            if stream is None:
                if payload == DONE:
                    raise line_error(f"{path}:{number}", "data: [DONE] without a stream before it", None, STREAM_FIX)
                stream, start = [], number
            if payload == DONE:
                records.append(_stream_record(path, start, request, stream))
                stream, request = None, None
            else:
                stream.append((number, payload))
            last = number
            continue
        if stream is not None:
            raise line_error(f"{path}:{start}", "the stream has no data: [DONE] line", None, STREAM_FIX)
        if request is not None:
            raise _no_response(path, request.line)
        obj = _json(f"{path}:{number}", text, "write one JSON object per line")
        if isinstance(obj, list) and obj and all(isinstance(item, dict) for item in obj):
            records.extend(Record(number, item, prefix=f"[{i}].") for i, item in enumerate(obj))
        elif not isinstance(obj, dict):
            raise line_error(f"{path}:{number}", f"a JSON {type(obj).__name__}, not an object", None,
                             "write one JSON object per line (or the list of objects /generate returns)")
        elif any(key in obj for key in RESPONSE_KEYS):
            records.append(Record(number, obj))
        else:
            request = Record(number, obj)
    if stream is not None:
        raise line_error(f"{path}:{last}", f"the stream from line {start} has no data: [DONE] line", None,
                         STREAM_FIX)
    if request is not None:
        raise _no_response(path, request.line)
    return records


def _no_response(path: Path, number: int) -> InputFileError:
    return line_error(f"{path}:{number}", "a request without a response", " | ".join(RESPONSE_KEYS),
                      "store the engine's response on the line, or its SSE stream (data: lines) right after it")


def _json(where: str, text: str, fix: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise line_error(where, f"not JSON ({exc.msg} at column {exc.colno})", None, fix) from None


def _stream_record(path: Path, start: int, request: Record | None, chunks: list[tuple[int, str]]) -> Record:
    events = []
    for number, payload in chunks:
        where = f"{path}:{number}"
        event = _json(where, payload, STREAM_FIX)
        if not isinstance(event, dict):
            raise line_error(where, f"a stream event that is a JSON {type(event).__name__}, not an object", "data",
                             STREAM_FIX)
        if "error" in event:
            raise line_error(where, f"the engine streamed an error: {str(event['error'])[:120]}", "error",
                             "store a stream that completed")
        events.append((where, event))
    native = sum("meta_info" in event for _, event in events)
    if native not in (0, len(events)):
        raise line_error(f"{path}:{start}", "a stream mixing SGLang /generate events and OpenAI chunks", None,
                         "save one request's stream per block, each ending data: [DONE]")
    response = _merge_sglang(events) if native else _merge_openai(events)
    obj = dict(request.obj) if request is not None else {}
    obj["response"] = response
    return Record(start, obj, stream=True)


def _merge_openai(events: list[tuple[str, dict]]) -> dict:
    merged: dict[int, dict] = {}
    response: dict = {}
    for where, chunk in events:
        if isinstance(chunk.get("prompt_token_ids"), list):
            response["prompt_token_ids"] = chunk["prompt_token_ids"]
        parts = chunk.get("choices")
        if not isinstance(parts, list):
            raise line_error(where, "a stream chunk without choices", "choices", STREAM_FIX)
        for i, part in enumerate(parts):
            index = part.get("index", 0) if isinstance(part, dict) else None
            if not isinstance(index, int) or isinstance(index, bool):
                raise line_error(where, "a choice that is not an object with an integer index",
                                 f"choices[{i}]", STREAM_FIX)
            _append_choice(merged.setdefault(index, {"index": index}), part)
    response["choices"] = [merged[i] for i in sorted(merged)]
    return response


def _append_choice(merged: dict, part: dict) -> None:
    if isinstance(part.get("text"), str):
        merged["text"] = merged.get("text", "") + part["text"]
    delta = part.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str):
        message = merged.setdefault("message", {"role": "assistant", "content": ""})
        message["content"] += delta["content"]
    if part.get("finish_reason") is not None:
        merged["finish_reason"] = part["finish_reason"]
    if isinstance(part.get("prompt_token_ids"), list):
        merged["prompt_token_ids"] = part["prompt_token_ids"]
    if isinstance(part.get("token_ids"), list):
        merged.setdefault("token_ids", []).extend(part["token_ids"])
    logprobs = part.get("logprobs")
    if not isinstance(logprobs, dict):
        return  # a role-only or final chunk: no tokens
    into = merged.setdefault("logprobs", {})
    for key in ("content", "tokens", "token_logprobs", "top_logprobs", "text_offset"):
        if isinstance(logprobs.get(key), list):
            into.setdefault(key, []).extend(logprobs[key])


def _merge_sglang(events: list[tuple[str, dict]]) -> dict | list[dict]:
    merged: dict[int, dict] = {}
    for where, event in events:
        meta = event["meta_info"]
        index = event.get("index", 0)
        if not isinstance(meta, dict) or not isinstance(index, int):
            raise line_error(where, "meta_info is not an object", "meta_info", STREAM_FIX)
        state = merged.setdefault(index, {"text": None, "meta_info": {}})
        gathered = state["meta_info"].get("output_token_logprobs", [])
        tokens = meta.get("output_token_logprobs")
        if not isinstance(tokens, list):
            state["meta_info"] = {**meta, "output_token_logprobs": gathered}
            continue  # the reader names the missing logprobs
        count = meta.get("completion_tokens")
        counted = isinstance(count, int) and not isinstance(count, bool)
        cumulative = tokens[:len(gathered)] == gathered and (not counted or len(tokens) == count)
        if not cumulative and counted and len(gathered) + len(tokens) != count:
            raise line_error(where, f"{len(tokens)} output_token_logprobs after {len(gathered)} streamed: neither "
                             f"all of completion_tokens ({count}) nor the rest of them",
                             "meta_info.output_token_logprobs", STREAM_FIX)
        top = meta.get("output_top_logprobs")
        gathered_top = state["meta_info"].get("output_top_logprobs")
        text = event.get("text") if isinstance(event.get("text"), str) else None
        if cumulative:
            text = state["text"] if text is None else text  # an intermediate event may leave its text out
        else:
            text = state["text"] if text is None else (state["text"] or "") + text
            tokens = gathered + tokens
            top = (gathered_top or []) + top if isinstance(top, list) else gathered_top
        state["text"] = text
        state["meta_info"] = {**meta, "output_token_logprobs": tokens, "output_top_logprobs": top}
    responses = [merged[i] for i in sorted(merged)]
    return responses[0] if len(responses) == 1 else responses
