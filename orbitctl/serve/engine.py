"""The serving engine: one policy, its named adapters, and one generation at a time.

Requests are serialised: the CPU (or the one GPU) decodes a single batch at a time, and a
request waits for the lock while at most ``max_waiting`` requests do; beyond that it is refused
(:class:`Busy`, HTTP 429). Adapters are swapped in place rather than held side by side in PEFT:
the policy has one set of adapter parameters, each loaded adapter is kept as a copy of those
tensors, and a request for another adapter copies its tensors in before decoding (the base
name decodes with the adapters switched off). That is the trainer's own layout, so a served
adapter computes exactly what it computed in training.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from orbitctl.errors import UserError

if TYPE_CHECKING:
    import torch


class RequestError(UserError):
    """A request the engine refuses; ``status`` and ``param`` become the OpenAI-style error."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class Busy(RequestError):
    """Too many requests are already waiting for the one generation slot."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"the server is busy: one request is generating and {waiting} are waiting; retry later",
                         status=429, code="server_busy")


@dataclass(frozen=True)
class TokenInfo:
    """One generated token as the responses show it."""

    id: int
    text: str
    """Its part of the completion's text (empty for EOS and other special tokens)."""
    token: str
    """The token itself as a string (special tokens by name)."""
    logprob: float
    offset: int
    """Where ``text`` starts in the completion."""
    top: list[tuple[str, float]] = field(default_factory=list)
    """The most likely tokens at this position, best first."""
    top_ids: list[int] = field(default_factory=list)
    """The ids of ``top``, in the same order."""


@dataclass(frozen=True)
class Choice:
    """One completion: its text, tokens and why it ended (``stop`` or ``length``)."""

    text: str
    tokens: list[TokenInfo]
    finish_reason: str
    routed_experts: "torch.Tensor | None" = None
    """When asked of an MoE base: [prompt tokens + completion tokens - 1, L_moe, k] the experts each token of the
    sequence but the last was routed to on the infer path (the prompt's at prefill, then the completion's)."""


@dataclass(frozen=True)
class Generation:
    """The completions of one request."""

    model: str
    prompt_ids: list[int]
    choices: list[Choice]
    seed: int


class Engine:
    """The policy behind the server, with its base name, loaded adapters and generation lock."""

    def __init__(self, policy, *, base_name: str, adapter_kind: str, context: int, max_waiting: int = 8) -> None:
        self.policy = policy
        self.base_name = base_name
        self.adapter_kind = adapter_kind
        self.context = context
        """Most tokens a sequence may hold, prompt and completion together (the base's positions)."""
        self.max_waiting = max_waiting
        self.adapters: dict[str, dict] = {}
        """lora_name -> {"path": str, "state": {parameter name: tensor}}."""
        self._active: str | None = None
        self._lock = threading.Lock()
        self._guard = threading.Lock()
        self._in_flight = 0

    # -- adapters ------------------------------------------------------------------------
    def models(self) -> list[dict]:
        """The base and every loaded adapter, as ``GET /v1/models`` lists them."""
        rows = [{"id": self.base_name, "parent": None, "root": self.base_name}]
        rows += [{"id": name, "parent": self.base_name, "root": a["path"]} for name, a in self.adapters.items()]
        return rows

    def load_adapter(self, name: str, path: str) -> None:
        """Read the adapter in ``path`` (a run's ``adapter/`` or ``checkpoints/step-N/adapter``) as ``name``."""
        from orbitctl.model.adapters import load_adapter_weights

        if name == self.base_name or name in self.adapters:
            raise RequestError(f"lora_name: {name!r} is already loaded; unload it first or pick another name",
                               param="lora_name")
        directory = Path(path)
        expected = "adapter_model.safetensors" if self.adapter_kind == "lora" else "bottleneck.safetensors"
        if not (directory / expected).is_file():
            raise RequestError(f"lora_path: {path} has no {expected} (adapter.kind is {self.adapter_kind})",
                               param="lora_path")
        with self._slot():
            try:
                load_adapter_weights(self.policy.model, directory, self.adapter_kind)
            except (RuntimeError, KeyError, ValueError, OSError) as exc:
                self._restore()
                raise RequestError(f"lora_path: {path} does not fit this server's base and adapter layout "
                                   f"({str(exc).splitlines()[0][:200]})", param="lora_path") from exc
            self.adapters[name] = {"path": str(path), "state": self._snapshot()}
            self._active = name

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter loaded as ``name``."""
        with self._slot():
            if name not in self.adapters:
                raise RequestError(f"lora_name: no adapter {name!r} is loaded", status=404, param="lora_name",
                                   code="model_not_found")
            del self.adapters[name]
            if self._active == name:
                self._active = None

    def _snapshot(self) -> dict:
        return {n: p.detach().clone() for n, p in self.policy.named_trainable()}

    def _restore(self) -> None:
        """Put the active adapter's tensors back (after a load that failed half-way)."""
        if self._active is not None:
            self._copy_in(self.adapters[self._active]["state"])

    def _copy_in(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.policy.named_trainable():
                p.copy_(state[n])

    def _using(self, model: str):
        """A context in which the policy computes as ``model``: the base (adapters off) or one adapter."""
        from orbitctl.model.adapters import adapters_disabled

        if model == self.base_name:
            return adapters_disabled(self.policy.model)
        if model not in self.adapters:
            known = ", ".join([self.base_name, *self.adapters])
            raise RequestError(f"model: {model!r} is not served here (serving: {known})", status=404, param="model",
                               code="model_not_found")
        if self._active != model:
            self._copy_in(self.adapters[model]["state"])
            self._active = model
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _slot(self):
        """Hold the one generation slot, refusing when it is held and ``max_waiting`` requests already wait."""
        with self._guard:
            if self._in_flight > self.max_waiting:  # one holds the slot, max_waiting wait for it
                raise Busy(self._in_flight - 1)
            self._in_flight += 1
        try:
            with self._lock:
                yield
        finally:
            with self._guard:
                self._in_flight -= 1

    # -- prompts ---------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids, tokenized as the trainer tokenizes a prompt without chat template."""
        return list(self.policy.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Chat turns through the tokenizer's chat template when it has one, else the project's plain
        rendering (:class:`~orbitctl.data.tasks.ChatPrompt`: ``role: content`` lines, then ``assistant:``).
        Under the template a request without a system turn gets the profile's ``data.system_prompt``, as the
        trainer's prompts did (:meth:`~orbitctl.model.policy.Policy.turns`)."""
        from orbitctl.data.tasks import ChatPrompt

        tokenizer = self.policy.tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(self.policy.turns(ChatPrompt(messages)), tokenize=False,
                                                 add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template writes BOS
        return self.encode_text(str(ChatPrompt(messages)))

    def check_ids(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """Refuse ids outside the vocabulary or a request longer than the context; returns max_tokens."""
        vocab = len(self.policy.tokenizer)
        if not ids:
            raise RequestError(f"{param}: the prompt is empty", param=param)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)
        room = self.context - len(ids)
        if room < 1:
            raise RequestError(f"{param}: {len(ids)} prompt tokens leave no room in the context of {self.context}",
                               param=param, code="context_length_exceeded")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise RequestError(f"max_tokens: {len(ids)} prompt tokens + {max_tokens} exceed the context of "
                               f"{self.context}; ask for at most {room}", param="max_tokens",
                               code="context_length_exceeded")
        return max_tokens

    # -- generation ------------------------------------------------------------------------
    def generate(self, model: str, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float,
                 n: int, seed: int | None, top_logprobs: int, stop: list[str]) -> Generation:
        """``n`` completions of ``prompt_ids`` on the infer path (:meth:`Policy.sample`); completion j draws
        from key j of ``seed`` (:class:`~orbitctl.model.draws.KeyedDraws`), so it does not depend on n."""
        return self.generate_batch(model, [prompt_ids], max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                   n=n, seed=seed, top_logprobs=top_logprobs, stop=stop)[0]

    def generate_batch(self, model: str, prompts: list[list[int]], *, max_tokens: int, temperature: float,
                       top_p: float, n: int, seed: int | None, top_logprobs: int, stop: list[str],
                       routed_experts: bool = False) -> list[Generation]:
        """``n`` completions of each prompt, decoded as one left-padded batch (as the trainer decodes a rollout
        chunk); completion j of prompt i draws from key ``i * n + j`` of ``seed``. ``routed_experts``: every
        choice carries its sequence's routing (:attr:`Choice.routed_experts`; an MoE base only)."""
        import torch

        from orbitctl.model.draws import KeyedDraws

        if routed_experts and self.policy.routing is None:
            raise RequestError("return_routed_experts: this server's base is a dense model (no MoE router), so "
                               "there are no routed experts to return; leave it false", param="return_routed_experts")
        seed = secrets.randbelow(2**63) if seed is None else seed
        rows = [p for p in prompts for _ in range(n)]
        width = max(len(p) for p in rows)
        pad = self.policy.pad_id
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], dtype=torch.long)
        with self._slot():
            with self._using(model):
                out = self.policy.sample(ids, mask, max_new_tokens=max_tokens, temperature=temperature,
                                         top_p=top_p, generator=None, keep_dist=top_logprobs > 0,
                                         draws=KeyedDraws(seed, tuple(range(len(rows)))) if temperature > 0 else None)
        return [Generation(model, list(p), [self._choice(out, i * n + j, top_logprobs, stop, max_tokens,
                                                         routed_experts) for j in range(n)], seed)
                for i, p in enumerate(prompts)]

    def _choice(self, out, row: int, top_logprobs: int, stop: list[str], max_tokens: int,
                routed_experts: bool = False) -> Choice:
        choice = self._text_choice(out, row, top_logprobs, stop, max_tokens)
        if not routed_experts:
            return choice
        return replace(choice, routed_experts=_sequence_routes(out, row, len(choice.tokens)))

    def _text_choice(self, out, row: int, top_logprobs: int, stop: list[str], max_tokens: int) -> Choice:
        tokenizer = self.policy.tokenizer
        kept = int(out.completion_mask[row].sum())
        ids = out.completion_ids[row, :kept].tolist()
        logps = out.logprobs[row, :kept].tolist()
        tokens, text = [], ""
        for i, (tid, logp) in enumerate(zip(ids, logps)):
            # a token's text is what it adds to the decoded prefix: right for multi-token characters too
            full = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
            top, top_ids = [], []
            if top_logprobs:
                values, order = out.dist[row, i].topk(top_logprobs)
                top_ids = order.tolist()
                top = [(tokenizer.decode([t]), v) for t, v in zip(top_ids, values.tolist())]
            tokens.append(TokenInfo(tid, full[len(text):], tokenizer.decode([tid]), logp, len(text), top, top_ids))
            text = full
        ended = bool(ids) and ids[-1] == self.policy.eos_id
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=None)
        if cut is not None:
            # keep the tokens that start before the stop string, their text up to it
            tokens = [t for t in tokens if t.offset < cut]
            return Choice(text[:cut], tokens, "stop")
        return Choice(text, tokens, "stop" if ended or kept < max_tokens else "length")


def _sequence_routes(out, row: int, tokens: int) -> "torch.Tensor":
    """Row ``row``'s routing as SGLang returns it, [P + tokens - 1, L, k]: its real prompt tokens' (recorded at
    prefill, the left padding dropped), then its first ``tokens - 1`` completion tokens' (the last is never fed)."""
    import torch

    prompt = out.prompt_routes[row][out.prompt_mask[row].bool()]
    return torch.cat([prompt, out.routes[row, :max(tokens - 1, 0)]], dim=0)
