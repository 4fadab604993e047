"""Engine rollouts in the OpenAI-compatible logprobs format that vLLM and SGLang return, and SGLang's native one.

File format: JSONL, one object per line, holding the request's prompt and the engine's response (or a
streamed response, or a ``/generate`` batch: see :mod:`orbitctl.align.rollout_file` for the framing).

- The prompt: ``"prompt": "text"`` (completions) or ``"messages": [...]`` (chat), and/or
  ``"prompt_token_ids": [ints]``. Ids are preferred when present: nothing is re-tokenised. They may sit
  on the line, in the response or on a choice (vLLM's ``return_token_ids``).
- The response: either under ``"response": {...}`` or merged at top level (``"choices": [...]``).
  Every choice of a line is one completion (n > 1 gives several).
- Completions shape: ``choices[i].logprobs = {"tokens": [str], "token_logprobs": [float],
  "top_logprobs": [{token_str: logprob, ...} | null], "text_offset": [...]}``.
- Chat shape: ``choices[i].logprobs.content = [{"token": str, "logprob": float, "bytes": [int] | null,
  "top_logprobs": [{"token": str, "logprob": float, "bytes": [int] | null}]}]``.
- Token ids directly: an optional ``"token_ids"`` list on a choice, or tokens written as ``"token_id:123"``
  (vLLM's ``--return-tokens-as-token-ids``).
- SGLang native ``/generate``: ``{"text": str, "meta_info": {"output_token_logprobs": [[logprob, id,
  text | null]], "output_top_logprobs": [[[logprob, id, text | null], ...] | null per position],
  (``[logprob, id]`` pairs, as lmdeploy's SGLang-compatible server sends them, read the same),
  "finish_reason": {"type": ...}}}``, under ``"response"`` beside the request (its ``"text"`` or
  ``"input_ids"`` is the prompt; the request may also sit under ``"request"``), or merged at top level
  with ``"input_ids"`` (there ``"text"`` is the completion). Ids come with every token.

A sampled token's logprob must be finite and <= 0 (a rounding excess up to 1e-6 is read as 0); a top-k
entry may be ``-inf`` (a masked token). ``echo`` responses (prompt tokens with a null first logprob) are
refused: the completion must hold only generated tokens.

Example line (completions)::

    {"prompt": "2+2=", "choices": [{"text": "4", "logprobs": {"tokens": ["4"], "token_logprobs": [-0.01],
     "top_logprobs": [{"4": -0.01, "5": -4.7}], "text_offset": [4]}}]}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from orbitctl.align.rollout_file import Record, line_error as _fail, read_records

TOKEN_ID_PREFIX = "token_id:"
LOGPROBS_FIX = ('request with logprobs (completions: "logprobs": K; chat: "logprobs": true, "top_logprobs": K) '
                "and store the whole response")
IDS_FIX = ("start vLLM with --return-tokens-as-token-ids (or request \"return_token_ids\": true), "
           "and send prompt_token_ids; check the tokenizer is the engine's")
SGLANG_LOGPROBS_FIX = ('request /generate with "return_logprob": true and "top_logprobs_num": K '
                       "and store the whole response")
POSITIVE_SLACK = 1e-6  # engines round log_softmax; a sampled token at p≈1 may print a hair above 0


@dataclass
class EngineCompletion:
    """One completion (one choice) read from a rollouts file, as the engine printed it."""

    line: int                     # 1-based line in the file
    prompt_text: str | None
    prompt_messages: list | None
    prompt_token_ids: list[int] | None
    tokens: list[str]             # as the engine printed them
    token_ids: list[int] | None   # when the engine gave ids
    logprobs: list[float]         # engine log-prob of each sampled token
    top: list[list[tuple[str | int, float]]]   # per position, the engine's top-K (token str or id, logprob)
    shape: str                    # "completions" | "chat" | "sglang"
    text: str | None = None       # the choice's text / message content, for the decode check
    finish_reason: str | None = None
    choice: int = 0               # index of the choice within its line
    path: str = ""
    token_bytes: list[list[int] | None] | None = None          # chat: UTF-8 bytes of each sampled token
    top_bytes: list[list[list[int] | None]] | None = None      # chat: bytes of each top-K entry


@dataclass
class ResolvedCompletion:
    """A completion in the trainer's token ids; K of ``top_ids`` may vary per position."""

    line: int
    choice: int
    prompt_ids: list[int]
    completion_ids: list[int]
    sampled_logp: list[float]
    top_ids: list[list[int]]
    top_logp: list[list[float]]
    notes: list[str] = field(default_factory=list)


def read_rollouts(path) -> list[EngineCompletion]:
    """Every completion of every record of a rollouts file (lines, batch elements, streams), in file order."""
    path = Path(path)
    if not path.is_file():
        raise _fail(str(path), "no such rollouts file", None,
                    "pass the JSONL file of requests and engine responses (--rollouts FILE.jsonl)")
    completions: list[EngineCompletion] = []
    for record in read_records(path):
        completions.extend(_read_record(path, record))
    if not completions:
        raise _fail(str(path), "empty file, no rollouts", None,
                    "write one JSON object per line: the prompt and the engine's response with logprobs")
    return completions


def _read_record(path: Path, record: Record) -> list[EngineCompletion]:
    where, obj = f"{path}:{record.line}", record.obj
    wrapped = "response" in obj
    response = obj["response"] if wrapped else obj
    prefix = record.prefix + ("response." if wrapped and not record.stream else "")
    request = obj.get("request", {})
    if not isinstance(request, dict):
        raise _fail(where, "the request is not an object", f"{record.prefix}request",
                    "store the request body as sent (an object)")
    # merged at the top level, "text" is SGLang's completion, not the request's prompt
    own = ("request", "response") if wrapped else ("request", "response", "text")
    fields = {**request, **{k: v for k, v in obj.items() if k not in own}}
    if isinstance(response, list) and wrapped:
        return _read_sglang_batch(path, record, fields, response, prefix)
    if not isinstance(response, dict):
        raise _fail(where, "the response is not an object", "response", "store the engine's JSON response")
    if "meta_info" in response:
        return [_read_sglang(path, record.line, fields, response, prefix, 0)]
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _fail(where, "no choices", f"{prefix}choices",
                    'store the engine\'s whole response under "response" or merge it into the line')
    prompt_text, messages, line_ids = _read_prompt(where, fields, response, prefix)
    out = []
    for i, choice in enumerate(choices):
        key = f"{prefix}choices[{i}]"
        if not isinstance(choice, dict):
            raise _fail(where, "a choice is not an object", key, "store the engine's response unchanged")
        ids = _int_list(where, choice.get("prompt_token_ids"), f"{key}.prompt_token_ids") or line_ids
        if prompt_text is None and messages is None and ids is None:
            raise _fail(where, "no prompt", "prompt | messages | prompt_token_ids",
                        "store the request's prompt (or its token ids) on the line")
        completion = _read_choice(where, choice, key)
        completion.line, completion.choice, completion.path = record.line, int(choice.get("index", i)), str(path)
        completion.prompt_text, completion.prompt_messages, completion.prompt_token_ids = prompt_text, messages, ids
        out.append(completion)
    return out


def _read_prompt(where: str, fields: dict, response: dict, prefix: str):
    """The prompt from the line's (or its ``request``'s) fields: OpenAI's, or SGLang's ``text``/``input_ids``."""
    prompt, messages = fields.get("prompt", fields.get("text")), fields.get("messages")
    id_key = "prompt_token_ids" if fields.get("prompt_token_ids") is not None else "input_ids"
    ids = _int_list(where, fields.get(id_key), id_key)
    if ids is None:
        ids = _int_list(where, response.get("prompt_token_ids"), f"{prefix}prompt_token_ids")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # the OpenAI API accepts a one-element list of prompts
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids, prompt = ids or [int(t) for t in prompt], None  # a prompt given as token ids
    if prompt is not None and not isinstance(prompt, str):
        raise _fail(where, "the prompt is neither a string nor a list of token ids", "prompt | text",
                    "one prompt per line; n > 1 completions go in choices")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise _fail(where, "messages is not a list of objects", "messages",
                    'write the chat request\'s messages: [{"role": ..., "content": ...}]')
    return prompt, messages, ids


def _read_sglang_batch(path: Path, record: Record, fields: dict, responses: list,
                       prefix: str) -> list[EngineCompletion]:
    """A ``/generate`` batch: the request's ``text`` (or ``input_ids``) list pairs one prompt with each response."""
    where = f"{path}:{record.line}"
    texts, id_lists = fields.get("text", fields.get("prompt")), fields.get("input_ids", fields.get("prompt_token_ids"))
    batched = texts if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts) else (
        id_lists if isinstance(id_lists, list) and id_lists and all(isinstance(t, list) for t in id_lists) else None)
    if batched is not None and len(batched) not in (1, len(responses)):
        raise _fail(where, f"{len(batched)} prompts for {len(responses)} responses", "text | input_ids",
                    "store one prompt per response (with n > 1, save each prompt's request on its own line)")
    out = []
    for i, response in enumerate(responses):
        key = f"{prefix}[{i}]."
        if not isinstance(response, dict) or "meta_info" not in response:
            raise _fail(where, "a batch response without meta_info", f"{key}meta_info",
                        "store the list /generate returned, unchanged")
        own = dict(fields)
        if batched is not None:
            own.update({"text": batched[min(i, len(batched) - 1)]} if batched is texts else
                       {"input_ids": batched[min(i, len(batched) - 1)], "prompt_token_ids": None, "text": None, "prompt": None})
        out.append(_read_sglang(path, record.line, own, response, key, i))
    return out


def _read_sglang(path: Path, line: int, fields: dict, response: dict, prefix: str, index: int) -> EngineCompletion:
    """One SGLang ``/generate`` response: ``meta_info.output_token_logprobs`` as ``[logprob, id, text | null]``
    triples or ``[logprob, id]`` pairs."""
    where = f"{path}:{line}"
    meta, key = response["meta_info"], f"{prefix}meta_info"
    if not isinstance(meta, dict):
        raise _fail(where, "meta_info is not an object", key, "store the engine's response unchanged")
    prompt_text, messages, ids = _read_prompt(where, fields, response, prefix)
    if prompt_text is None and messages is None and ids is None:
        raise _fail(where, "no prompt", "text | input_ids | prompt_token_ids",
                    'store the /generate request beside its response: {"text" or "input_ids": ..., "response": {...}}')
    triples, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
    if not isinstance(triples, list):
        raise _fail(where, "output_token_logprobs missing", f"{key}.output_token_logprobs", SGLANG_LOGPROBS_FIX)
    if tops is not None and (not isinstance(tops, list) or len(tops) != len(triples)):
        got = len(tops) if isinstance(tops, list) else type(tops).__name__
        raise _fail(where, f"output_top_logprobs holds {got} positions, output_token_logprobs {len(triples)}",
                    f"{key}.output_top_logprobs", "store the engine's response unchanged")
    tokens, token_ids, sampled, top = [], [], [], []
    for j, triple in enumerate(triples):
        here = f"{key}.output_token_logprobs[{j}]"
        value, token_id, text = _triple(where, triple, here)
        sampled.append(_sampled_logprob(where, value, here))
        token_ids.append(token_id)
        tokens.append(text or "")
        entries = tops[j] if tops is not None else None
        if entries is not None and not isinstance(entries, list):
            raise _fail(where, "a top-logprobs position is not a list", f"{key}.output_top_logprobs[{j}]",
                        "store the engine's response unchanged")
        row = []
        for m, entry in enumerate(entries or []):
            at = f"{key}.output_top_logprobs[{j}][{m}]"
            alt_value, alt_id, _ = _triple(where, entry, at)
            row.append((alt_id, _top_logprob(where, alt_value, at)))
        top.append(row)
    finish = meta.get("finish_reason")
    completion = EngineCompletion(line, prompt_text, messages, ids, tokens, token_ids, sampled, top, "sglang",
                                  choice=index, path=str(path))
    completion.text = response.get("text") if isinstance(response.get("text"), str) else None
    completion.finish_reason = finish.get("type") if isinstance(finish, dict) else finish
    return completion


def _triple(where: str, value, key: str) -> tuple:
    """``[logprob, token_id, text | null]`` (SGLang) or ``[logprob, token_id]`` (lmdeploy's SGLang-compatible
    server: no text slot) as (logprob, token_id, text or None)."""
    if not (isinstance(value, list) and len(value) in (2, 3) and isinstance(value[0], (int, float))
            and not isinstance(value[0], bool) and isinstance(value[1], int) and not isinstance(value[1], bool)
            and value[1] >= 0 and (len(value) == 2 or value[2] is None or isinstance(value[2], str))):
        raise _fail(where, f"{json.dumps(value)[:60]} is not a [logprob, token_id, text | null] triple or a "
                    "[logprob, token_id] pair", key, "store SGLang's meta_info unchanged (return_logprob: true)")
    return value[0], value[1], value[2] if len(value) == 3 else None


def _int_list(where: str, value, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise _fail(where, "not a list of token ids (integers >= 0)", key, "store the engine's ids unchanged")
    return list(value)


def _read_choice(where: str, choice: dict, key: str) -> EngineCompletion:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        raise _fail(where, "logprobs missing", f"{key}.logprobs", LOGPROBS_FIX)
    if isinstance(logprobs.get("content"), list):
        completion = _read_chat(where, logprobs["content"], f"{key}.logprobs.content")
        message = choice.get("message") or {}
        completion.text = message.get("content") if isinstance(message, dict) else None
    elif isinstance(logprobs.get("tokens"), list):
        completion = _read_completions(where, logprobs, f"{key}.logprobs")
        completion.text = choice.get("text") if isinstance(choice.get("text"), str) else None
    else:
        raise _fail(where, "logprobs has neither tokens nor content", f"{key}.logprobs", LOGPROBS_FIX)
    completion.finish_reason = choice.get("finish_reason")
    given = _int_list(where, choice.get("token_ids"), f"{key}.token_ids")
    if given is not None and len(given) != len(completion.tokens):
        raise _fail(where, f"{len(given)} token_ids but {len(completion.tokens)} tokens", f"{key}.token_ids",
                    "store the engine's response unchanged")
    if given is None and completion.tokens and all(t.startswith(TOKEN_ID_PREFIX) for t in completion.tokens):
        given = [_placeholder_id(where, t, f"{key}.logprobs") for t in completion.tokens]
    completion.token_ids = given
    return completion


def _read_completions(where: str, logprobs: dict, key: str) -> EngineCompletion:
    tokens, values, tops = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(values, list):
        raise _fail(where, "token_logprobs missing", f"{key}.token_logprobs", LOGPROBS_FIX)
    if len(tokens) != len(values):
        raise _fail(where, f"{len(tokens)} tokens but {len(values)} token_logprobs", f"{key}.token_logprobs",
                    "store the engine's response unchanged")
    if tops is not None and (not isinstance(tops, list) or len(tops) != len(tokens)):
        raise _fail(where, f"top_logprobs does not hold one entry per token ({len(tokens)})",
                    f"{key}.top_logprobs", "store the engine's response unchanged")
    sampled, top = [], []
    for j, (token, value) in enumerate(zip(tokens, values)):
        if not isinstance(token, str):
            raise _fail(where, "a token is not a string", f"{key}.tokens[{j}]", "store the response unchanged")
        sampled.append(_sampled_logprob(where, value, f"{key}.token_logprobs[{j}]"))
        entry = tops[j] if tops is not None else None
        if entry is not None and not isinstance(entry, dict):
            raise _fail(where, "a top_logprobs entry is not an object", f"{key}.top_logprobs[{j}]",
                        "store the response unchanged")
        here = f"{key}.top_logprobs[{j}]"
        top.append([(_top_token(where, t, here), _top_logprob(where, v, here)) for t, v in (entry or {}).items()])
    return EngineCompletion(0, None, None, None, list(tokens), None, sampled, top, "completions")


def _read_chat(where: str, content: list, key: str) -> EngineCompletion:
    tokens, sampled, top, token_bytes, top_bytes = [], [], [], [], []
    for j, entry in enumerate(content):
        here = f"{key}[{j}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise _fail(where, "an entry without a token string", here, "store the response unchanged")
        if "logprob" not in entry:
            raise _fail(where, "logprob missing", f"{here}.logprob", LOGPROBS_FIX)
        tokens.append(entry["token"])
        sampled.append(_sampled_logprob(where, entry["logprob"], f"{here}.logprob"))
        token_bytes.append(_bytes(where, entry.get("bytes"), f"{here}.bytes"))
        alternatives = entry.get("top_logprobs") or []
        if not isinstance(alternatives, list):
            raise _fail(where, "top_logprobs is not a list", f"{here}.top_logprobs", "store the response unchanged")
        row, row_bytes = [], []
        for m, alt in enumerate(alternatives):
            alt_key = f"{here}.top_logprobs[{m}]"
            if not isinstance(alt, dict) or not isinstance(alt.get("token"), str):
                raise _fail(where, "an entry without a token string", alt_key, "store the response unchanged")
            row.append((_top_token(where, alt["token"], alt_key), _top_logprob(where, alt.get("logprob"), alt_key)))
            row_bytes.append(_bytes(where, alt.get("bytes"), f"{alt_key}.bytes"))
        top.append(row)
        top_bytes.append(row_bytes)
    return EngineCompletion(0, None, None, None, tokens, None, sampled, top, "chat",
                            token_bytes=token_bytes, top_bytes=top_bytes)


def _sampled_logprob(where: str, value, key: str) -> float:
    if value is None:
        raise _fail(where, "logprob is null (an echo response holds the prompt's tokens)", key,
                    "request without echo, with logprobs")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _fail(where, f"sampled-token logprob {value!r} is not a finite number", key,
                    "store the engine's logprobs unchanged")
    if value > POSITIVE_SLACK:
        raise _fail(where, f"logprob {value} > 0 is not a log-probability", key,
                    "store log-probabilities (log p <= 0), not probabilities or logits")
    return min(float(value), 0.0)


def _top_logprob(where: str, value, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) or value > POSITIVE_SLACK:
        raise _fail(where, f"top logprob {value!r} is not a log-probability (<= 0)", key,
                    "store the engine's top_logprobs unchanged")
    return min(float(value), 0.0)


def _top_token(where: str, token: str, key: str) -> str | int:
    return _placeholder_id(where, token, key) if token.startswith(TOKEN_ID_PREFIX) else token


def _placeholder_id(where: str, token: str, key: str) -> int:
    suffix = token[len(TOKEN_ID_PREFIX):]
    if not suffix.isdigit():
        raise _fail(where, f"{token!r} is not a token_id:N placeholder", key, "store the response unchanged")
    return int(suffix)


def _bytes(where: str, value, key: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(b, int) and 0 <= b < 256 for b in value):
        raise _fail(where, "bytes is not a list of 0..255", key, "store the response unchanged")
    return value


def resolve_ids(completions: list[EngineCompletion], tokenizer) -> list[ResolvedCompletion]:
    """The completions in ``tokenizer``'s ids: prompt ids, sampled ids and top-K ids, with decode notes.

    Ids come, in order of trust, from the engine (``token_ids``, ``token_id:N``), from ``bytes``, and
    from a map of every id's decoded string (then its raw vocabulary name), built once.
    """
    token_map = _TokenMap(tokenizer)
    return [_resolve_one(c, tokenizer, token_map) for c in completions]


def _resolve_one(c: EngineCompletion, tokenizer, token_map) -> ResolvedCompletion:
    where = f"{c.path}:{c.line}"
    key = f"choices[{c.choice}].logprobs" + (".content" if c.shape == "chat" else ".tokens")
    prompt_ids = _prompt_ids(c, tokenizer, where)
    completion_ids = []
    for j, token in enumerate(c.tokens):
        if c.token_ids is not None:
            completion_ids.append(c.token_ids[j])
            continue
        raw = c.token_bytes[j] if c.token_bytes else None
        last_stop = j == len(c.tokens) - 1 and c.finish_reason == "stop"
        completion_ids.append(token_map.token_id(token, raw, last_stop, where, f"{key}[{j}]"))
    top_ids, top_logp = [], []
    for j, row in enumerate(c.top):
        ids, values = [], []
        for m, (token, value) in enumerate(row):
            raw = c.top_bytes[j][m] if c.top_bytes else None
            tid = token if isinstance(token, int) else token_map.token_id(
                token, raw, False, where, _top_key(c, j, m))
            if tid not in ids:  # vLLM may list the sampled token twice (in the top-K and as the extra one)
                ids.append(tid)
                values.append(value)
        top_ids.append(ids)
        top_logp.append(values)
    size = len(tokenizer)
    outside = next((t for t in [*prompt_ids, *completion_ids, *(t for row in top_ids for t in row)] if t >= size), None)
    if outside is not None:
        raise _fail(where, f"token id {outside} is outside the tokenizer's vocabulary of {size}",
                    "meta_info" if c.shape == "sglang" else f"choices[{c.choice}]",
                    "verify with the tokenizer of the model the engine served")
    notes = _consistency_notes(c, tokenizer, completion_ids, top_ids, top_logp, where)
    return ResolvedCompletion(c.line, c.choice, prompt_ids, completion_ids, list(c.logprobs), top_ids, top_logp,
                              notes)


def _top_key(c: EngineCompletion, j: int, m: int) -> str:
    inner = f"content[{j}].top_logprobs[{m}]" if c.shape == "chat" else f"top_logprobs[{j}] entry {m}"
    return f"choices[{c.choice}].logprobs.{inner}"


class _TokenMap:
    """Engine token strings to ids, built once on first use from three views of the vocabulary, in order:

    the text a token adds after another token (what an incremental detokenizer such as vLLM's prints:
    SentencePiece's "▁hello" reads " hello", not "hello"), the token decoded alone, and its vocabulary name.
    A string is resolved by the first view that knows it, and only when it names exactly one id there.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.views: list[dict[str, list[int]]] | None = None

    def _build(self) -> None:
        tok, size = self.tokenizer, len(self.tokenizer)
        alone = tok.batch_decode([[i] for i in range(size)])
        anchor = (tok("a", add_special_tokens=False)["input_ids"] or [None])[-1]
        head = tok.decode([anchor]) if anchor is not None else ""
        in_context = [text[len(head):] if text.startswith(head) else None
                      for text in tok.batch_decode([[anchor, i] for i in range(size)])] if head else []
        names = tok.convert_ids_to_tokens(list(range(size)))
        self.views = [_index(in_context), _index(alone), _index(names)]

    def token_id(self, token: str, raw: list[int] | None, last_stop: bool, where: str, key: str) -> int:
        if token.startswith(TOKEN_ID_PREFIX):
            return _placeholder_id(where, token, key)
        if self.views is None:
            self._build()
        keys = [token] if raw is None else [bytes(raw).decode("utf-8", errors="replace"), token]
        candidates: list[int] = []
        for text in keys:  # the bytes first: they survive JSON escaping and odd token names
            found = next((view[text] for view in self.views if text in view), [])
            if len(found) == 1:
                return found[0]
            candidates = candidates or found
        eos = self.tokenizer.eos_token_id
        if last_stop and eos is not None and (not token or eos in candidates):
            return eos  # engines print EOS as "" when they skip special tokens
        what = (f"token {token!r} maps to no id of the tokenizer" if not candidates else
                f"token {token!r} maps to {len(candidates)} ids ({', '.join(map(str, candidates[:5]))})")
        raise _fail(where, what, key, IDS_FIX)


def _index(texts: list[str | None]) -> dict[str, list[int]]:
    index: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        if text is not None:
            index.setdefault(text, []).append(i)
    return index


def _prompt_ids(c: EngineCompletion, tokenizer, where: str) -> list[int]:
    if c.prompt_token_ids is not None:
        return list(c.prompt_token_ids)
    if c.prompt_text is not None:
        return list(tokenizer(c.prompt_text)["input_ids"])  # as Policy.encode_prompts tokenises prompts
    if not getattr(tokenizer, "chat_template", None):
        raise _fail(where, "a chat rollout, but the tokenizer has no chat template", "messages",
                    "send prompt_token_ids with each line, or use the engine model's tokenizer")
    text = tokenizer.apply_chat_template(c.prompt_messages, add_generation_prompt=True, tokenize=False)
    # the rendered template already holds BOS; engines tokenise it without adding special tokens
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _consistency_notes(c, tokenizer, completion_ids, top_ids, top_logp, where) -> list[str]:
    notes = []
    if c.text is not None and completion_ids:
        decoded = tokenizer.decode(completion_ids, skip_special_tokens=True)
        if decoded != c.text:
            at = next((i for i, (a, b) in enumerate(zip(decoded, c.text)) if a != b), min(len(decoded), len(c.text)))
            notes.append(f"{where}: choice {c.choice}: decoded completion differs from the engine's text "
                         f"at character {at} ({decoded[at:at + 12]!r} vs {c.text[at:at + 12]!r})")
    for j, (tid, value) in enumerate(zip(completion_ids, c.logprobs)):
        if tid in top_ids[j]:
            listed = top_logp[j][top_ids[j].index(tid)]
            if abs(listed - value) > 1e-4 and math.isfinite(listed):
                notes.append(f"{where}: choice {c.choice}: token {j}'s logprob {value} differs from its "
                             f"top-K entry {listed}")
                break
    return notes
