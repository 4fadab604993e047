"""Rollout through an inference engine behind HTTP (``rollout.engine: http``).

Each rollout the trainer saves its adapter in PEFT format, hot-loads it into the engine and samples
the step's completions there, with token ids and per-token log-probs; the update then trains on
the engine's tokens, with the importance correction and align loss on the engine's log-probs.

Two wire protocols, chosen by ``rollout.engine_api``:

- ``vllm``: ``POST /v1/load_lora_adapter {lora_name, lora_path}`` (vLLM with runtime LoRA updating),
  ``POST /v1/completions`` with token-id prompts, ``"model": lora_name``, ``logprobs: 0`` and
  ``return_tokens_as_token_ids: true`` (each token named ``token_id:N``);
- ``sglang``: ``POST /load_lora_adapter {lora_name, lora_path}``, ``POST /generate`` with ``input_ids``,
  ``lora_path: lora_name``, ``return_logprob: true`` (``meta_info.output_token_logprobs``); on an MoE base
  with ``rl.router_replay`` also ``return_routed_experts: true`` (``meta_info.routed_experts``: the experts each token was routed to,
  which the update replays with ``rl.router_replay``).

``orbitctl serve`` speaks both, and is what train starts on loopback when ``rollout.engine_url`` is
unset: with a fresh API key of its own and adapter loading fenced to the run's ``engine/`` directory.
Every request carries ``Authorization: Bearer KEY`` when there is a key (for an engine at
``rollout.engine_url``: ``ORBITCTL_API_KEY`` from the environment, vLLM's ``--api-key`` or
``orbitctl serve``'s); the key is never logged, put in an event or written to the run directory. A call that fails (no connection, timeout, HTTP 5xx or 429, an answer that does not parse or
holds ids outside the vocabulary) is retried ``rollout.engine_retries`` times with backoff; then the
step fails naming the URL and the answer, before any update, so the newest checkpoint stays the
state a rerun resumes from.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orbitctl.errors import RunFailed

if TYPE_CHECKING:
    import torch

BACKOFF_S = 0.5
"""First wait before a retry; doubled each time, at most :data:`BACKOFF_MAX_S`."""
BACKOFF_MAX_S = 8.0
START_TIMEOUT_S = 300.0
"""Longest wait for a started ``orbitctl serve`` to answer ``/health``."""
RESUME_FIX = ("the newest checkpoint is intact: bring the engine back (or fix rollout.engine_url) and rerun the "
              "same command to resume")
API_KEY_ENV = "ORBITCTL_API_KEY"
"""The environment variable holding the key of an engine at ``rollout.engine_url`` (the one ``orbitctl serve`` reads)."""
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


class EngineFailed(RunFailed):
    """The http engine did not give a usable answer within its retries (exit 1)."""


class _Retry(Exception):
    """A failed attempt worth repeating; ``answer`` says what came back."""

    def __init__(self, answer: str) -> None:
        super().__init__(answer)
        self.answer = answer


@dataclass
class Completion:
    """One sampled completion: the engine's token ids and the log-prob it gave each."""

    ids: list[int]
    logprobs: list[float]
    routes: "torch.Tensor | None" = None
    """[len(ids), L_moe, k] int16 the experts each token was routed to on the engine (-1: none returned, as for the
    last token); only when asked (``routed_experts``)."""


class HttpEngine:
    """A client of one engine: adapter hot-load and sampling, each call retried with backoff."""

    def __init__(self, url: str, api: str, *, vocab_size: int, timeout_s: float, retries: int,
                 backoff_s: float = BACKOFF_S, api_key: str | None = None) -> None:
        self.root = root_url(url)
        self.api = api
        self.vocab_size = vocab_size
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:  # never the key
        return f"HttpEngine({self.root!r}, {self.api!r}, key={'set' if 'Authorization' in self._headers else 'none'})"

    # -- adapters -----------------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> None:
        route = "/v1/load_lora_adapter" if self.api == "vllm" else "/load_lora_adapter"
        self._call(route, {"lora_name": name, "lora_path": str(Path(path).resolve())}, f"loading adapter {name}",
                   expect_json=self.api == "sglang")

    def unload_adapter(self, name: str) -> None:
        route = "/v1/unload_lora_adapter" if self.api == "vllm" else "/unload_lora_adapter"
        self._call(route, {"lora_name": name}, f"unloading adapter {name}", expect_json=self.api == "sglang")

    # -- sampling -----------------------------------------------------------------------------
    def sample(self, model: str, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float,
               top_p: float, seed: int, routed_experts: tuple[int, int] | None = None) -> list[Completion]:
        """``n`` completions of every prompt, completion j of prompt i at ``i * n + j``. ``routed_experts`` = (MoE
        layers, top-k): also each token's experts (:attr:`Completion.routes`; SGLang's protocol only)."""
        if self.api == "vllm":
            if routed_experts is not None:
                raise ValueError("routed experts come back only over SGLang's protocol (rollout.engine_api: sglang)")
            body = {"model": model, "prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                    "top_p": top_p, "seed": seed, "logprobs": 0, "return_tokens_as_token_ids": True}
            return self._call("/v1/completions", body, "sampling", parse=lambda a: self._vllm(a, len(prompts) * n))
        body = {"input_ids": prompts, "lora_path": model, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                    "n": n, "sampling_seed": seed}}
        if routed_experts is not None:
            body["return_routed_experts"] = True
        lengths = [len(p) for p in prompts for _ in range(n)]
        return self._call("/generate", body, "sampling",
                          parse=lambda a: self._sglang(a, len(prompts) * n, lengths, routed_experts))

    def _vllm(self, answer, rows: int) -> list[Completion]:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != rows:
            raise _Retry(f"{rows} choices expected, got {_describe(choices)}")
        out = []
        for choice in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0):
            lp = choice.get("logprobs") if isinstance(choice, dict) else None
            if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
                raise _Retry("a choice without logprobs.tokens (start vLLM with a logprobs-capable build)")
            ids = [_token_id(t) for t in lp["tokens"]]
            out.append(self._completion(ids, lp.get("token_logprobs")))
        return out

    def _sglang(self, answer, rows: int, prompt_lengths: list[int] | None = None,
                routed_experts: tuple[int, int] | None = None) -> list[Completion]:
        answers = [answer] if isinstance(answer, dict) else answer
        if not isinstance(answers, list) or len(answers) != rows:
            raise _Retry(f"{rows} results expected, got {_describe(answers)}")
        out = []
        for one in answers:
            meta = one.get("meta_info") if isinstance(one, dict) else None
            entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
            # [logprob, id, text] triples (SGLang) or [logprob, id] pairs (lmdeploy's SGLang-compatible server)
            if not isinstance(entries, list) or not all(isinstance(t, list) and len(t) in (2, 3) for t in entries):
                raise _Retry("a result without meta_info.output_token_logprobs as [logprob, id, text] triples or "
                             "[logprob, id] pairs")
            completion = self._completion([t[1] for t in entries], [t[0] for t in entries])
            if routed_experts is not None:
                completion.routes = parse_routed_experts(meta.get("routed_experts"), prompt_lengths[len(out)],
                                                         len(completion.ids), *routed_experts)
            out.append(completion)
        return out

    def _completion(self, ids, logprobs) -> Completion:
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise _Retry(f"{len(ids)} tokens but {_describe(logprobs)} log-probs")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise _Retry(f"token id {bad!r} outside the trainer's vocabulary (0..{self.vocab_size - 1})")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= 1e-3 for v in logprobs):
            raise _Retry("a log-prob that is not a finite number <= 0")
        return Completion(list(ids), [float(v) for v in logprobs])

    # -- transport ----------------------------------------------------------------------------
    def _call(self, route: str, body: dict, what: str, *, parse=None, expect_json: bool = True):
        """POST ``body`` to ``route``; the parsed answer. Retries what may pass on another try."""
        url = self.root + route
        data = json.dumps(body).encode()
        last = "no answer"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), BACKOFF_MAX_S))
            try:
                text = self._post(url, data, what)
                if not expect_json and parse is None:
                    return text
                answer = _json(text)
                return parse(answer) if parse is not None else answer
            except _Retry as exc:
                last = exc.answer
        raise EngineFailed(f"rollout engine {url}: {what} failed after {self.retries + 1} attempts: {last}",
                           fix=RESUME_FIX)

    def _post(self, url: str, data: bytes, what: str) -> str:
        request = urllib.request.Request(url, data=data, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            detail = _error_message(exc.read().decode("utf-8", errors="replace"))
            if exc.code >= 500 or exc.code in (408, 429):
                raise _Retry(f"HTTP {exc.code}: {detail}") from exc
            if exc.code == 401:
                raise EngineFailed(f"rollout engine {url}: {what} was refused (HTTP 401: {detail})",
                                   fix=f"export {API_KEY_ENV} with the engine's API key; " + RESUME_FIX) from exc
            # the engine refused the request itself: the same request would be refused again
            raise EngineFailed(f"rollout engine {url}: {what} was refused (HTTP {exc.code}: {detail})",
                               fix="check rollout.engine_api and that the engine serves this profile's base with "
                                   "LoRA enabled; " + RESUME_FIX) from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            reason = getattr(exc, "reason", exc)
            raise _Retry(f"{type(reason).__name__}: {reason}") from exc


ROUTED_EXPERTS_FIX = "start SGLang with --enable-return-routed-experts"


def parse_routed_experts(payload, prompt_tokens: int, tokens: int, layers: int, top_k: int) -> "torch.Tensor":
    """SGLang's ``meta_info.routed_experts`` for a completion of ``tokens`` tokens after a prompt of
    ``prompt_tokens``: base64 of little-endian int32 over the sequence's tokens but the last (prompt first), each
    ``layers`` x ``top_k``. Returns the completion's part as [tokens, layers, top_k] int16, the last token's row
    -1 (never routed: it was not fed back)."""
    import numpy as np
    import torch

    from orbitctl.model.router_replay import NOT_RECORDED, ROUTE_DTYPE

    where = "meta_info.routed_experts"
    if not isinstance(payload, str):
        raise _Retry(f"a result without {where} ({ROUTED_EXPERTS_FIX})")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _Retry(f"{where} that is not base64 ({ROUTED_EXPERTS_FIX})") from None
    rows = max(prompt_tokens + tokens - 1, 0)
    expected = rows * layers * top_k
    if len(raw) != 4 * expected:
        raise _Retry(f"{where} of {len(raw)} bytes, expected {4 * expected} ({rows} tokens x {layers} MoE layers x "
                     f"top-{top_k} int32: {ROUTED_EXPERTS_FIX}, serving this profile's base)")
    experts = np.frombuffer(raw, dtype="<i4").reshape(rows, layers, top_k)
    most = torch.iinfo(ROUTE_DTYPE).max
    if experts.size and (experts.min() < NOT_RECORDED or experts.max() > most):
        raise _Retry(f"{where} holds an expert index outside {NOT_RECORDED}..{most}")
    routes = torch.full((tokens, layers, top_k), NOT_RECORDED, dtype=ROUTE_DTYPE)
    generated = experts[prompt_tokens:]
    routes[:len(generated)] = torch.from_numpy(generated.astype(np.int16))
    return routes


def root_url(url: str) -> str:
    """The server's root: ``http://h:p`` for ``http://h:p``, ``http://h:p/`` or ``http://h:p/v1``."""
    root = url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise _Retry(f"an answer that is not JSON: {text[:120]!r}") from None


def _error_message(text: str) -> str:
    """OpenAI's ``error.message`` (or FastAPI's ``detail``) when the body has one, else its start."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:200]
        if body.get("detail") or body.get("message"):
            return str(body.get("detail") or body.get("message"))[:200]
    return text[:200]


def _token_id(token) -> int:
    """``token_id:N`` (vLLM's ``return_tokens_as_token_ids``) as N."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    raise _Retry(f"a token {token!r} not named token_id:N (the engine ignored return_tokens_as_token_ids; start "
                 f"vLLM with --return-tokens-as-token-ids)")


def _describe(value) -> str:
    return f"{len(value)}" if isinstance(value, list) else type(value).__name__


# -- adapter publication --------------------------------------------------------------------------
class AdapterSync:
    """Publishes the trainer's adapter to the engine before each rollout (rank 0; the others wait).

    Each publication is a new directory under ``RUN/engine/`` and a new name (``NAME-TAG-step-N``: a
    fresh tag per process, so a resumed run never collides with names a previous one left loaded);
    the previous one is unloaded and removed once the new one is in.
    """

    def __init__(self, engine: HttpEngine, policy, run_root: Path, base_name: str, tag: str, rank: int) -> None:
        self.engine, self.policy, self.rank = engine, policy, rank
        self.directory = run_root / "engine"
        self.prefix = f"{base_name}-{tag}"
        self.current: tuple[str, Path] | None = None

    def publish(self, step: int) -> str:
        """The adapter as of ``step`` loaded into the engine; returns the model name to sample from."""
        from orbitctl.dist.collectives import barrier

        from orbitctl.model.adapters import adapter_gathered, save_adapter
        from orbitctl.rundir import atomic_dir

        name, path = f"{self.prefix}-step-{step}", self.directory / f"step-{step}"
        with adapter_gathered(self.policy.model):  # every rank: ZeRO-3 gathers the adapter for rank 0's save
            if self.rank == 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                atomic_dir(path, lambda tmp: save_adapter(self.policy.model, tmp, self.policy.adapter_kind,
                                                          self.policy.hidden_size), replace=True)
        if self.rank == 0:
            self.engine.load_adapter(name, path)
            if self.current is not None and self.current[0] != name:
                old_name, old_path = self.current
                self.engine.unload_adapter(old_name)
                shutil.rmtree(old_path, ignore_errors=True)
        self.current = (name, path)
        barrier()
        return name


def process_tag(rank: int) -> str:
    """A tag shared by every rank of this run's processes (rank 0 draws it)."""
    from orbitctl.dist.collectives import broadcast_objects

    box = [secrets.token_hex(3) if rank == 0 else None]
    broadcast_objects(box, src=0)
    return str(box[0])


# -- rollout --------------------------------------------------------------------------------------
def keyed_runs(positions, group_size: int, max_prompts: int) -> list[tuple[int, int]]:
    """``(first row, prompts)`` for each request that samples the prompts at ``positions`` (row i at position
    ``positions[i]``), in row order: runs of consecutive positions that one seed can key.

    A run of R prompts from position p0 is keyed by ``offset_seed(seed, p0 * G, R * G)``, which exists when
    ``p0 * G`` is a multiple of a power of two of at least ``R * G`` (any R when p0 is 0). Each run takes
    as many prompts as that, the positions' consecutiveness and ``max_prompts`` allow (a buddy allocator's
    aligned blocks); a prompt that cannot be keyed even alone is a run of its own (it gets its own seed)."""
    runs: list[tuple[int, int]] = []
    row, rows = 0, len(positions)
    while row < rows:
        p0 = int(positions[row])
        offset = p0 * group_size
        aligned = offset & -offset  # the largest power of two dividing the offset
        fits = rows if offset == 0 else aligned // group_size
        count = 1
        while (row + count < rows and count < min(fits, max_prompts)
               and int(positions[row + count]) == p0 + count):
            count += 1
        runs.append((row, count))
        row += count
    return runs


def request_seed(seed: int, position: int, group_size: int, prompts: int) -> int:
    """The seed of a request for ``prompts`` prompts from ``position`` on, as a signed 64-bit integer (what
    engines take; the keyed draws read its 64 bits either way): keyed as in :func:`keyed_runs`, else (one
    prompt that cannot be keyed) a seed of the prompt's own."""
    from orbitctl.model.draws import offset_seed, splitmix64

    keyed = offset_seed(seed, position * group_size, prompts * group_size)
    if keyed is None:
        if prompts != 1:
            raise ValueError(f"{prompts} prompts from position {position} cannot share a keyed seed")
        keyed = splitmix64(seed ^ splitmix64(position))
    return keyed - (1 << 64) if keyed >= 1 << 63 else keyed


def collect_http(engine: HttpEngine, model: str, policy, items, reward_fn, *, group_size: int, batch_size: int,
                 max_new_tokens: int, temperature: float, top_p: float, seed: int, positions):
    """One step's experience for ``items``, sampled by the engine in as few requests as the draw keys allow.

    The prompts go out in the runs of :func:`keyed_runs` (at most ``batch_size`` sequences, ``batch_size //
    group_size`` prompts, per request; ``n`` = the group). A run's seed is
    :func:`~orbitctl.model.draws.offset_seed` of the run's seed at its first prompt's keys (position x group
    size), so an engine drawing completion j of prompt i from key ``i * n + j`` of the seed (``orbitctl
    serve``) samples the tokens the shared engine would; another engine takes it as its own seed.

    With ``rl.router_replay`` (``policy.router_replay``) on an MoE base, an SGLang-protocol engine also returns
    each token's experts, which become the batch's ``routes`` (as the shared engine records them, the last token
    of each row not routed). Without it nothing is asked: an SGLang started without
    ``--enable-return-routed-experts`` serves such a run.
    """
    import torch

    from orbitctl.model.router_replay import NOT_RECORDED, ROUTE_DTYPE
    from orbitctl.rl.rollout import _pad_left, rewarded

    start = time.perf_counter()
    routing = policy.routing
    routed = (routing.layers, routing.top_k) \
        if routing is not None and policy.router_replay and engine.api == "sglang" else None
    expanded = [it for it in items for _ in range(group_size)]
    ids, mask = policy.encode_prompts([it.prompt for it in items])
    prompt_parts, completions = [], []
    for first, count in keyed_runs(positions, group_size, max(1, batch_size // group_size)):
        rows = range(first, first + count)
        prompts = [ids[row][mask[row].bool()].tolist() for row in rows]
        completions += engine.sample(model, prompts, n=group_size, max_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, seed=request_seed(seed, int(positions[first]), group_size, count),
                                     routed_experts=routed)
        prompt_parts += [(ids[row:row + 1], mask[row:row + 1]) for row in rows for _ in range(group_size)]
    width = max(1, max(len(c.ids) for c in completions))
    pad = policy.pad_id
    completion_ids = torch.full((len(completions), width), pad, dtype=torch.long)
    completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
    logprobs = torch.zeros((len(completions), width), dtype=torch.float32)
    routes = None if routed is None else torch.full((len(completions), width, *routed), NOT_RECORDED,
                                                    dtype=ROUTE_DTYPE)
    for row, c in enumerate(completions):
        k = min(len(c.ids), max_new_tokens)
        completion_ids[row, :k] = torch.tensor(c.ids[:k], dtype=torch.long)
        completion_mask[row, :k] = 1
        logprobs[row, :k] = torch.tensor(c.logprobs[:k], dtype=torch.float32)
        if routes is not None:
            routes[row, :k] = c.routes[:k]
    prompts = (_pad_left([p[0] for p in prompt_parts], pad), _pad_left([p[1] for p in prompt_parts], 0))
    return rewarded(policy, expanded, prompts, (completion_ids, completion_mask), logprobs, None, reward_fn, start,
                    routes=routes)


# -- a started engine -----------------------------------------------------------------------------
def engine_endpoint(engine_url: str | None, profile_file: Path, run_root: Path, rank: int, closing, *,
                    max_batch: int = 1024) -> tuple[str, str | None]:
    """(URL, API key) of this run's engine: ``engine_url`` with ``ORBITCTL_API_KEY`` from the environment, or
    (rank 0, unset URL) an ``orbitctl serve`` started on loopback and entered on ``closing`` (an ExitStack),
    with its own key, ``RUN/engine/`` as its adapter root and ``max_batch`` completions allowed per request.
    Other ranks get the URL and key by broadcast."""
    from orbitctl.dist.collectives import broadcast_objects

    box = [(engine_url, os.environ.get(API_KEY_ENV) or None)]
    if engine_url is None and rank == 0:
        started = closing.enter_context(ServeProcess(profile_file, run_root / "engine.log", run_root / "engine",
                                                     max_batch=max_batch))
        box = [(started.url, started.api_key)]
    broadcast_objects(box, src=0)
    return box[0]


class ServeProcess:
    """``orbitctl serve`` on a free loopback port, started for this run and stopped with it.

    It gets a fresh API key (``api_key``, through its environment, never its command line) and loads
    adapters only from ``adapter_root``: another local user can neither sample from it nor make it read
    their files."""

    def __init__(self, profile_file: Path, log_file: Path, adapter_root: Path,
                 start_timeout_s: float = START_TIMEOUT_S, max_batch: int = 1024) -> None:
        self.profile_file, self.log_file, self.start_timeout_s = profile_file, log_file, start_timeout_s
        self.adapter_root, self.max_batch = adapter_root, max_batch
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.api_key = secrets.token_urlsafe(32)

    def __enter__(self) -> "ServeProcess":
        from orbitctl.rl.engine import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        env[API_KEY_ENV] = self.api_key
        env["ORBITCTL_SERVE_PARENT"] = str(os.getpid())  # the server ends with this process, even when it is killed
        command = [sys.executable, "-c", "import sys; from orbitctl.cli.app import main; sys.exit(main())", "serve",
                   str(self.profile_file), "--host", "127.0.0.1", "--port", str(port), "--allow-adapter-loading",
                   "--adapter-root", str(self.adapter_root.resolve()), "--max-batch", str(self.max_batch)]
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineFailed(f"orbitctl serve, started for rollout.engine: http, exited with code "
                                   f"{self.process.returncode}: {_tail(self.log_file)}",
                                   fix=f"see {self.log_file}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise EngineFailed(f"orbitctl serve at {self.url} did not answer /health within {self.start_timeout_s:.0f} s",
                           fix=f"see {self.log_file}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "no output"
