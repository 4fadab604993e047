"""Who may call the server and what it may read: the API key, the bind rule, the adapter fence, request limits.

- **API key.** With a key (``--api-key`` or ``ORBITCTL_API_KEY``) every route but ``GET /health``
  needs ``Authorization: Bearer KEY`` (401 otherwise), as vLLM's ``--api-key`` does. The key is
  compared in constant time and never logged, echoed or counted.
- **Bind rule.** A non-loopback address without a key is refused before anything loads: it would
  let every host that reaches the port sample, and swap the adapter under a running training.
- **Adapter fence.** Loading adapters at run time (``/v1/load_lora_adapter``, SGLang's
  ``/load_lora_adapter``, and their unload routes) is off unless ``--allow-adapter-loading``, and
  then reads only directories under ``--adapter-root``: a path with ``..`` is refused, the rest is
  resolved (symlinks followed) and must stay under the resolved root, and so must every entry of
  the directory (a symlinked weight file pointing out is refused). Refusals are 403; nothing
  outside the root is opened.
- **Limits.** Prompt tokens, ``max_tokens``, ``n`` and completions per request are bounded; a
  request over one is answered 400 naming the limit and the flag that sets it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from orbitctl.errors import UserError
from orbitctl.serve.engine import RequestError

API_KEY_ENV = "ORBITCTL_API_KEY"
"""The environment variable ``orbitctl serve`` reads its key from, and the http rollout client sends."""
OPEN_ROUTES = frozenset({"/health"})
"""Routes answered without the key (a load balancer's or a starting trainer's probe)."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one request, each answered 400 with its name when exceeded."""

    max_prompt_tokens: int | None = None
    """Most tokens one prompt may hold (``--max-prompt-tokens``; unset: the base's context)."""
    max_tokens: int | None = None
    """Most tokens one completion may ask for (``--max-tokens``; unset: what the context leaves)."""
    max_n: int = 16
    """Most completions of one prompt (``--max-n``)."""
    max_batch: int = 1024
    """Most completions one request may ask for, prompts x n (``--max-batch``)."""

    def check_n(self, n: int, prompts: int, param: str) -> None:
        """Refuse ``n`` over :attr:`max_n`, or ``prompts`` x ``n`` over :attr:`max_batch`."""
        if n > self.max_n:
            raise RequestError(f"n: {n} completions exceed this server's limit of {self.max_n} per prompt "
                               f"(--max-n)", param="n", code="limit_exceeded")
        if prompts * n > self.max_batch:
            raise RequestError(f"{param}: {prompts} prompts x n={n} exceed this server's limit of {self.max_batch} "
                               f"completions per request (--max-batch)", param=param, code="limit_exceeded")

    def check_prompt(self, ids: list[int], param: str) -> None:
        """Refuse a prompt longer than :attr:`max_prompt_tokens`."""
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise RequestError(f"{param}: {len(ids)} prompt tokens exceed this server's limit of "
                               f"{self.max_prompt_tokens} (--max-prompt-tokens)", param=param, code="limit_exceeded")

    def tokens(self, asked: int | None, room: int, param: str = "max_tokens") -> int:
        """The completion length to generate: ``asked`` (refused over :attr:`max_tokens`), else what the
        context leaves (``room``) capped at :attr:`max_tokens`."""
        if asked is None:
            return room if self.max_tokens is None else min(room, self.max_tokens)
        if self.max_tokens is not None and asked > self.max_tokens:
            raise RequestError(f"{param}: {asked} exceeds this server's limit of {self.max_tokens} tokens per "
                               f"completion (--max-tokens)", param=param, code="limit_exceeded")
        return asked


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, ``localhost``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse a key that is empty, or a non-loopback bind without a key (exit 2)."""
    if api_key is not None and not api_key.strip():
        raise UserError(f"--api-key ({API_KEY_ENV}): the key is empty",
                        fix="give a non-empty key, e.g. export ORBITCTL_API_KEY=$(openssl rand -hex 24)")
    if api_key is None and not is_loopback(host):
        raise UserError(f"--host {host}: serving beyond loopback needs an API key; without one any host that "
                        "reaches the port can sample and swap adapters",
                        fix=f"set {API_KEY_ENV} (or pass --api-key KEY) and send it as 'Authorization: Bearer KEY', "
                            "or bind --host 127.0.0.1")


class AdapterFence:
    """Where run-time adapter loads may read from: nowhere, or directories under one root."""

    def __init__(self, allow: bool = False, root: str | Path | None = None) -> None:
        self.allow = allow
        self.root = Path(os.path.realpath(root)) if root is not None else None

    @classmethod
    def from_options(cls, allow: bool, root: str | None) -> "AdapterFence":
        """The fence ``--allow-adapter-loading`` and ``--adapter-root`` describe; a root without the flag, the flag
        without a root, or a root that is not a directory is refused (exit 2)."""
        if root is not None and not allow:
            raise UserError(f"--adapter-root {root}: only used with --allow-adapter-loading",
                            fix="add --allow-adapter-loading, or drop --adapter-root")
        if allow and root is None:
            raise UserError("--allow-adapter-loading: needs --adapter-root DIR, the only directory adapters load from",
                            fix="e.g. --allow-adapter-loading --adapter-root runs/")
        if root is not None and not Path(root).is_dir():
            raise UserError(f"--adapter-root {root}: no such directory", fix="create it, or pass an existing one")
        return cls(allow, root)

    def resolve(self, raw: str) -> Path:
        """The directory ``raw`` names, resolved, if this fence lets it be read; else a 403 RequestError."""
        self.require_allowed()
        path = Path(raw)
        if ".." in path.parts:
            raise _forbidden(f"lora_path: {raw}: '..' is not allowed; name a directory under the adapter root")
        resolved = Path(os.path.realpath(path if path.is_absolute() else self.root / path))
        if not resolved.is_relative_to(self.root):
            raise _forbidden(f"lora_path: {raw} is outside this server's adapter root (--adapter-root)")
        if resolved.is_dir():
            with os.scandir(resolved) as entries:
                for entry in entries:
                    if not Path(os.path.realpath(entry.path)).is_relative_to(self.root):
                        raise _forbidden(f"lora_path: {raw}/{entry.name} leads outside this server's adapter root "
                                         "(--adapter-root)")
        return resolved

    def require_allowed(self) -> None:
        """Refuse (403) run-time adapter management, loading or unloading, where it is off."""
        if not self.allow or self.root is None:
            raise _forbidden("loading adapters at run time is off on this server; start it with "
                             "--allow-adapter-loading --adapter-root DIR, or load adapters at start with --adapter",
                             "adapter_loading_disabled")


def _forbidden(message: str, code: str = "adapter_path_forbidden") -> RequestError:
    return RequestError(message, status=403, param="lora_path", code=code)


class ApiKeyAuth:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every route but :data:`OPEN_ROUTES`, else 401."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                given = value
                break
        if secrets.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        body = {"error": {"message": "missing or wrong API key: send 'Authorization: Bearer KEY' with the server's "
                                     "key", "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
