"""A :class:`~orbitctl.serve.engine.Generation` in OpenAI's response shapes, whole or as stream chunks.

Completions carry ``logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``; chat carries
``logprobs.content[].{token, logprob, bytes, top_logprobs}``. Both add vLLM's token-id extras:
``prompt_token_ids`` on the response and ``token_ids`` on every choice (EOS included when it was
generated), so a trainer can use the exact tokens without re-tokenizing the text.
"""

from __future__ import annotations

import base64
import time
import uuid

from orbitctl.serve.engine import Choice, Generation, TokenInfo


def _piece(choice: Choice, token: TokenInfo) -> str:
    """The token's text, cut where the completion was cut by a stop string."""
    return choice.text[token.offset:token.offset + len(token.text)]


def _usage(gen: Generation) -> dict:
    completion = sum(len(c.tokens) for c in gen.choices)
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(gen.prompt_ids) + completion}


def _completion_logprobs(choice: Choice, tokens: list[TokenInfo], with_top: bool, as_ids: bool = False) -> dict:
    """OpenAI's completion ``logprobs``; ``as_ids`` names tokens ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``)."""
    def name(token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if as_ids else text

    return {"tokens": [name(t.id, t.token) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{name(i, s): v for i, (s, v) in zip(t.top_ids, t.top)} for t in tokens]
            if with_top else None,
            "text_offset": [t.offset for t in tokens]}


def _chat_entry(token: TokenInfo) -> dict:
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token.encode()),
            "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in token.top]}


def _head(kind: str, gen: Generation) -> dict:
    return {"id": f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": gen.model, "system_fingerprint": f"orbitctl-seed-{gen.seed}"}


def completion(gens: Generation | list[Generation], logprobs: int | None, as_ids: bool = False) -> dict:
    """The body of a ``POST /v1/completions`` answer: one prompt's generation, or a batch's (choice
    ``i * n + j`` is completion j of prompt i, each with its own ``prompt_token_ids``)."""
    batch = gens if isinstance(gens, list) else [gens]
    choices = [{"index": len(batch[0].choices) * g + i, "text": c.text, "finish_reason": c.finish_reason,
                "token_ids": [t.id for t in c.tokens], "prompt_token_ids": gen.prompt_ids,
                "logprobs": None if logprobs is None else _completion_logprobs(c, c.tokens, logprobs > 0, as_ids)}
               for g, gen in enumerate(batch) for i, c in enumerate(gen.choices)]
    body = {**_head("text_completion", batch[0]), "choices": choices}
    if not isinstance(gens, list):
        body["prompt_token_ids"] = gens.prompt_ids
    usage = [_usage(gen) for gen in batch]
    return {**body, "usage": {k: sum(u[k] for u in usage) for k in usage[0]}}


def sglang_generate(gens: list[Generation], return_logprob: bool, top: int,
                    routed_experts: bool = False) -> dict | list[dict]:
    """SGLang's ``/generate`` answer: one object for one prompt and one completion, else a list (completion j
    of prompt i at ``i * n + j``); log-probs as ``[logprob, id, text]`` triples in ``meta_info``, and with
    ``routed_experts`` each sequence's routing (:func:`routed_experts_payload`) as ``meta_info.routed_experts``."""
    out = []
    for gen in gens:
        for c in gen.choices:
            meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(c.tokens),
                    "finish_reason": {"type": c.finish_reason}}
            if return_logprob:
                meta["output_token_logprobs"] = [[t.logprob, t.id, t.token] for t in c.tokens]
                meta["output_top_logprobs"] = [[[v, i, s] for i, (s, v) in zip(t.top_ids, t.top)] for t in c.tokens] \
                    if top else None
            if routed_experts:
                meta["routed_experts"] = routed_experts_payload(c.routed_experts)
            out.append({"text": c.text, "output_ids": [t.id for t in c.tokens], "meta_info": meta})
    return out[0] if len(out) == 1 else out


def routed_experts_payload(routes) -> str:
    """SGLang's ``routed_experts``: a routing [N, L, k] as base64 of little-endian int32, (token, layer, slot) order."""
    return base64.b64encode(routes.numpy().astype("<i4").tobytes()).decode("ascii")


def chat(gen: Generation, logprobs: bool) -> dict:
    """The body of a ``POST /v1/chat/completions`` answer."""
    choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason, "token_ids": [t.id for t in c.tokens],
                "logprobs": {"content": [_chat_entry(t) for t in c.tokens]} if logprobs else None}
               for i, c in enumerate(gen.choices)]
    return {**_head("chat.completion", gen), "choices": choices, "prompt_token_ids": gen.prompt_ids,
            "usage": _usage(gen)}


def completion_chunks(gen: Generation, logprobs: int | None, as_ids: bool = False):
    """The stream of a completion: one chunk per token and choice, then each choice's finish chunk."""
    head = _head("text_completion", gen)
    for i, c in enumerate(gen.choices):
        for t in c.tokens:
            lp = None if logprobs is None else _completion_logprobs(c, [t], logprobs > 0, as_ids)
            yield {**head, "choices": [{"index": i, "text": _piece(c, t), "finish_reason": None,
                                        "token_ids": [t.id], "logprobs": lp}]}
        yield {**head, "choices": [{"index": i, "text": "", "finish_reason": c.finish_reason, "token_ids": [],
                                    "logprobs": None}]}


def chat_chunks(gen: Generation, logprobs: bool):
    """The stream of a chat completion: the role, one delta per token, then each choice's finish chunk."""
    head = {**_head("chat.completion", gen), "object": "chat.completion.chunk"}
    for i, c in enumerate(gen.choices):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None, "logprobs": None}]}
        for t in c.tokens:
            yield {**head, "choices": [{"index": i, "delta": {"content": _piece(c, t)}, "finish_reason": None,
                                        "token_ids": [t.id],
                                        "logprobs": {"content": [_chat_entry(t)]} if logprobs else None}]}
        yield {**head, "choices": [{"index": i, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}]}
