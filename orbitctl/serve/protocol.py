"""The request bodies the server accepts, shaped like OpenAI's (and vLLM's adapter endpoints).

Every model forbids fields it does not know, so a sampling option the server does not honour is
refused (422) instead of silently ignored. Bounds that do not depend on the loaded model or the
server's options are here; the context and vocabulary are checked by :mod:`orbitctl.serve.engine`,
the server's limits (``n``, prompt tokens, ``max_tokens``, batch) by :mod:`orbitctl.serve.security`.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's chat limit)."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    """The base's name or a loaded adapter's ``lora_name`` (``GET /v1/models`` lists them)."""
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 is greedy; log-probs are those of the temperature-scaled distribution, as the trainer records them."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the smallest set of tokens whose mass reaches top_p."""
    n: int = Field(1, ge=1)
    """Completions of the one prompt; completion j draws from key j of ``seed`` (at most the server's ``--max-n``)."""
    seed: int | None = Field(None, ge=-2**63, lt=2**63)
    """The keyed draws' seed, a signed 64-bit integer (its 64 bits are the key); the same seed gives the same
    tokens (default: a fresh random one)."""
    stop: Union[str, list[str], None] = None
    """A completion is cut before the first of these strings (at most 4)."""
    stream: bool = False
    """Send server-sent events ``data: {...}`` chunks, one per token, then ``data: [DONE]``."""

    @model_validator(mode="after")
    def _check_stop(self):
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: give at most 4 non-empty strings")
        return self

    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: Union[str, list[int], list[list[int]]]
    """The prompt as text (tokenized as the trainer tokenizes a prompt), as token ids used as they are, or a batch
    of token-id prompts (choice ``i * n + j`` is completion j of prompt i, decoded as one batch)."""
    max_tokens: int = Field(16, ge=1)
    """Most tokens generated per completion; prompt + max_tokens must fit the base's context."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Return each token's log-prob and this many top alternatives."""
    echo: Literal[False] = False
    """Echoing the prompt is not supported; only false is accepted."""
    return_tokens_as_token_ids: bool = False
    """vLLM's option: name every token in ``logprobs`` as ``token_id:N`` (exact ids, whatever the tokenizer)."""
    return_token_ids: bool | None = None
    """vLLM's option; ``token_ids`` and ``prompt_token_ids`` are returned on every choice either way."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: turns rendered by the tokenizer's chat template, else plainly."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens generated per completion (default: what is left of the context)."""
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for ``max_tokens``; give one or the other."""
    logprobs: bool = False
    """Return each token's log-prob."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives per token; needs ``logprobs: true``."""

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens and max_completion_tokens: give one of them")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def token_budget(self) -> int | None:
        """The requested completion length, whichever name carried it."""
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


class LoadLoraRequest(BaseModel):
    """``POST /v1/load_lora_adapter``, as vLLM takes it."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``, as vLLM takes it."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


class SGLangSampling(BaseModel):
    """``sampling_params`` of SGLang's ``/generate``: the subset the infer path carries out."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    """Completions of each prompt (at most the server's ``--max-n``)."""
    sampling_seed: int | None = Field(None, ge=-2**63, lt=2**63)
    """The keyed draws' seed (SGLang's name); the same seed gives the same tokens."""


class SGLangGenerateRequest(BaseModel):
    """``POST /generate``, SGLang's native route: token ids in, ``meta_info.output_token_logprobs`` out."""

    model_config = ConfigDict(extra="forbid")

    input_ids: Union[list[int], list[list[int]]]
    """One prompt's ids or a batch of them (answer ``i * n + j``: completion j of prompt i)."""
    sampling_params: SGLangSampling = Field(default_factory=SGLangSampling)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    lora_path: str | None = None
    """A loaded adapter's name (SGLang selects adapters by the name given at load); unset = the base."""
    stream: Literal[False] = False
    """Streaming the native route is not supported; only false is accepted."""
    return_routed_experts: bool = False
    """SGLang's option: ``meta_info.routed_experts`` on every result, the experts each token of the sequence but
    the last was routed to (an MoE base only; base64 of little-endian int32, (token, MoE layer, slot) order)."""

    def batch(self) -> list[list[int]]:
        """``input_ids`` as a list of prompts."""
        ids = self.input_ids
        return [list(ids)] if not ids or isinstance(ids[0], int) else [list(p) for p in ids]


class SGLangLoadLoraRequest(BaseModel):
    """``POST /load_lora_adapter``, as SGLang takes it."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False
    """SGLang's option (keep the adapter resident); every loaded adapter stays resident here."""
