"""The FastAPI application: OpenAI's routes over an :class:`~orbitctl.serve.engine.Engine`.

Every error is OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request
the engine refuses, 404 for an unknown model or route, 413 for a body over the limit, 422 for a
body that does not validate, 429 when the generation queue is full, 500 (no traceback) otherwise;
401 without the API key and 403 for an adapter load the fence refuses (:mod:`orbitctl.serve.security`).
Route handlers are plain functions, so FastAPI runs them on its thread pool and a waiting request
never blocks the event loop.
"""

from __future__ import annotations

import json
import logging

from orbitctl.serve import responses
from orbitctl.serve.engine import Engine, RequestError
from orbitctl.serve.protocol import (ChatRequest, CompletionRequest, LoadLoraRequest, SGLangGenerateRequest,
                                     SGLangLoadLoraRequest, UnloadLoraRequest)
from orbitctl.serve.security import AdapterFence, ApiKeyAuth, Limits

MAX_BODY_BYTES = 1 << 20
"""Largest request body accepted (1 MiB: far above any prompt that fits a context)."""

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error"}

log = logging.getLogger("orbitctl.serve")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error document."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


class BodyLimit:
    """ASGI middleware refusing a request body over ``limit`` bytes (413) before it is read whole."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(413, f"the request body is over {self.limit} bytes", code="body_too_large"))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})


class _TooLarge(Exception):
    pass


def create_app(engine: Engine, *, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
               fence: AdapterFence | None = None, limits: Limits | None = None):
    """The ASGI app serving ``engine``: behind ``api_key`` when given, loading adapters at run time only
    where ``fence`` lets it (default: nowhere), each request within ``limits``."""
    fence = fence if fence is not None else AdapterFence()
    limits = limits if limits is not None else Limits()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="orbitctl serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [p for p in first.get("loc", ()) if p != "body"]
        # a body that is not JSON at all is located at a character offset, not at a field
        param = ".".join(str(p) for p in loc) if loc and isinstance(loc[0], str) else None
        return JSONResponse(error_body(422, f"{param or 'body'}: {first.get('msg')}", param, "invalid_value"),
                            status_code=422)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("request failed")  # the traceback goes to the server's log, never to the client
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    def asked_tokens(body, field: str) -> int:
        """``field`` as the request set it; its default is capped at ``--max-tokens`` rather than refused."""
        value = getattr(body, field)
        if field in body.model_fields_set or limits.max_tokens is None:
            return value
        return min(value, limits.max_tokens)

    def checked(ids: list[int], asked: int | None, param: str, tokens_param: str = "max_tokens") -> int:
        """The completion length for prompt ``ids``, within the context and the server's limits."""
        limits.check_prompt(ids, param)
        room = engine.check_ids(ids, None, param)
        if asked is not None and asked > room:
            engine.check_ids(ids, asked, param)  # names the context it exceeds
        return limits.tokens(asked, room, tokens_param)

    def sse(chunks):
        def events():
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{**m, "object": "model", "created": 0, "owned_by": "orbitctl",
                                            "max_model_len": engine.context} for m in engine.models()]}

    @app.post("/v1/completions")
    def completions(body: CompletionRequest):
        as_ids = body.return_tokens_as_token_ids
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], list):
            prompts = [list(p) for p in body.prompt]
            if body.stream:
                raise RequestError("stream: a batch of prompts is answered whole; send one prompt to stream",
                                   param="stream")
            limits.check_n(body.n, len(prompts), "prompt")
            max_tokens = min(checked(p, asked_tokens(body, "max_tokens"), f"prompt[{i}]") for i, p in enumerate(prompts))
            gens = engine.generate_batch(body.model, prompts, max_tokens=max_tokens, temperature=body.temperature,
                                         top_p=body.top_p, n=body.n, seed=body.seed, top_logprobs=body.logprobs or 0,
                                         stop=body.stop_list())
            return responses.completion(gens, body.logprobs, as_ids)
        limits.check_n(body.n, 1, "prompt")
        ids = engine.encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        max_tokens = checked(ids, asked_tokens(body, "max_tokens"), "prompt")
        gen = engine.generate(body.model, ids, max_tokens=max_tokens, temperature=body.temperature,
                              top_p=body.top_p, n=body.n, seed=body.seed, top_logprobs=body.logprobs or 0,
                              stop=body.stop_list())
        if body.stream:
            return sse(responses.completion_chunks(gen, body.logprobs, as_ids))
        return responses.completion(gen, body.logprobs, as_ids)

    @app.post("/generate")
    def sglang_generate(body: SGLangGenerateRequest):
        prompts, sp = body.batch(), body.sampling_params
        limits.check_n(sp.n, len(prompts), "input_ids")
        max_tokens = min(checked(p, asked_tokens(sp, "max_new_tokens"), "input_ids", "sampling_params.max_new_tokens")
                         for p in prompts)
        gens = engine.generate_batch(body.lora_path or engine.base_name, prompts, max_tokens=max_tokens,
                                     temperature=sp.temperature, top_p=sp.top_p, n=sp.n, seed=sp.sampling_seed,
                                     top_logprobs=body.top_logprobs_num if body.return_logprob else 0, stop=[],
                                     routed_experts=body.return_routed_experts)
        return responses.sglang_generate(gens, body.return_logprob, body.top_logprobs_num, body.return_routed_experts)

    def sglang_adapters() -> dict:
        """SGLang's answer to an adapter call: success and what is loaded now."""
        return {"success": True, "error_message": "", "loaded_adapters": {n: a["path"] for n, a in engine.adapters.items()}}

    @app.post("/load_lora_adapter")
    def sglang_load_lora_adapter(body: SGLangLoadLoraRequest):
        engine.load_adapter(body.lora_name, str(fence.resolve(body.lora_path)))
        return sglang_adapters()

    @app.post("/unload_lora_adapter")
    def sglang_unload_lora_adapter(body: UnloadLoraRequest):
        fence.require_allowed()
        engine.unload_adapter(body.lora_name)
        return sglang_adapters()

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatRequest):
        limits.check_n(body.n, 1, "messages")
        ids = engine.encode_chat([(m.role, m.content) for m in body.messages])
        max_tokens = checked(ids, body.token_budget(), "messages",
                             "max_tokens" if body.max_tokens is not None else "max_completion_tokens")
        gen = engine.generate(body.model, ids, max_tokens=max_tokens, temperature=body.temperature,
                              top_p=body.top_p, n=body.n, seed=body.seed,
                              top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0, stop=body.stop_list())
        if body.stream:
            return sse(responses.chat_chunks(gen, body.logprobs))
        return responses.chat(gen, body.logprobs)

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(body: LoadLoraRequest):
        engine.load_adapter(body.lora_name, str(fence.resolve(body.lora_path)))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(body: UnloadLoraRequest):
        fence.require_allowed()
        engine.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    limited = BodyLimit(app, max_body_bytes)
    return ApiKeyAuth(limited, api_key) if api_key is not None else limited
