"""Build the serving engine from a profile and run the HTTP server, in the foreground or a thread.

The policy is the one the trainer builds (:func:`orbitctl.builder.load_policy` over the profile's
frozen quantized base, warm-started on the same task, so the cache serves the trained base);
adapters given at start are loaded before the first request. :func:`start_background` runs the
same server on a thread, for tests and for a trainer that samples from it over HTTP. Who may
call it and what it may read is :class:`Access` (:mod:`orbitctl.serve.security`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orbitctl.errors import RunFailed, UserError
from orbitctl.serve.engine import Engine, RequestError
from orbitctl.serve.security import AdapterFence, Limits, check_exposure

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def parse_adapter_arg(value: str) -> tuple[str, str]:
    """``NAME=DIR`` or ``DIR`` (named after the directory: ``runs/x/adapter`` -> ``adapter``)."""
    name, sep, path = value.partition("=")
    if not sep:
        name, path = Path(value).name or value, value
    if not name or not path:
        raise UserError(f"--adapter {value}: expected DIR or NAME=DIR", fix="e.g. --adapter step100=runs/x/adapter")
    return name, path


def build_engine(profile, adapters: list[tuple[str, str]] = (), *, max_waiting: int = 8) -> Engine:
    """The profile's policy on its device, with ``adapters`` ((name, directory) pairs) loaded."""
    import torch

    from orbitctl.builder import load_policy, prepare_frozen_base
    from orbitctl.data.prompts import load_prompts

    split = load_prompts(profile.data, profile.run.seed)
    torch.manual_seed(profile.run.seed)
    policy = load_policy(profile, prepare_frozen_base(profile, split.warm_task))
    context = int(getattr(policy.model.config, "max_position_embeddings", 0) or profile.memory.seq_len)
    engine = Engine(policy, base_name=profile.name, adapter_kind=profile.adapter.kind, context=context,
                    max_waiting=max_waiting)
    for name, path in adapters:
        try:
            engine.load_adapter(name, path)
        except RequestError as exc:
            raise UserError(f"--adapter {name}={path}: {exc.message.partition(': ')[2]}",
                            fix="Pass the adapter/ directory of a run of this profile") from exc
    return engine


@dataclass(frozen=True)
class Access:
    """Who may call the server (``api_key``: None = anyone who reaches it), where run-time adapter loads may
    read (``fence``) and the bounds on one request (``limits``)."""

    api_key: str | None = None
    fence: AdapterFence = AdapterFence()
    limits: Limits = Limits()


@dataclass(frozen=True)
class Startup:
    """What a server tells whoever started it once its port is bound: where it listens, what it serves and who
    may call it (``orbitctl serve --json`` prints it as one JSON document)."""

    url: str
    """The base URL an OpenAI client takes (ends in ``/v1``)."""
    host: str
    port: int
    """The bound port (the one the system chose, for ``--port 0``)."""
    pid: int
    base: str
    """The model name that asks for the base alone: the profile's name."""
    adapters: list[str]
    """The model names of the adapters loaded at start."""
    api_key_required: bool
    adapter_loading: bool
    """Whether clients may load and unload adapters at run time."""
    adapter_root: str | None
    """The only directory run-time loads read from (resolved), when they are allowed."""
    limits: dict
    """The bounds on one request (:class:`orbitctl.serve.security.Limits`)."""

    @classmethod
    def of(cls, engine: Engine, host: str, port: int, access: Access) -> "Startup":
        root = access.fence.root if access.fence.allow else None
        return cls(url=f"http://{host}:{port}/v1", host=host, port=port, pid=os.getpid(), base=engine.base_name,
                   adapters=list(engine.adapters), api_key_required=access.api_key is not None,
                   adapter_loading=access.fence.allow, adapter_root=None if root is None else str(root),
                   limits=asdict(access.limits))

    def to_dict(self) -> dict:
        return asdict(self)


def _server(engine: Engine, host: str, port: int, log_level: str, access: Access):
    import uvicorn

    from orbitctl.serve.app import create_app

    app = create_app(engine, api_key=access.api_key, fence=access.fence, limits=access.limits)
    # no access log: request lines are not needed, and nothing a client sends is written anywhere
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot bind ({exc.strerror})",
                        fix="pick a free port with --port, or stop what holds this one") from exc
    return sock


def serve(engine: Engine, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, access: Access = Access(),
          on_ready=None) -> None:
    """Serve ``engine`` until interrupted (Ctrl+C or SIGTERM end it cleanly); ``on_ready`` gets the
    :class:`Startup` once the port is bound and listening."""
    check_exposure(host, access.api_key)
    sock = _bind(host, port)
    sock.listen()  # from here a client may connect: the kernel holds it until the server takes it
    if on_ready is not None:
        on_ready(Startup.of(engine, host, sock.getsockname()[1], access))
    _server(engine, host, port, "warning", access).run(sockets=[sock])


PARENT_ENV = "ORBITCTL_SERVE_PARENT"
"""Set (to its pid) by a process that starts ``orbitctl serve`` for itself (train's own engine): the server
ends when that process does, instead of holding its port and CPU after a killed run."""


def _exit_with_parent() -> None:
    """Linux: SIGTERM this server when the process named in :data:`PARENT_ENV` dies (uvicorn then shuts down)."""
    import os
    import signal
    import sys

    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if str(os.getppid()) != parent:  # it died before the request was in place
        raise RunFailed(f"the process that started this server ({parent}) has already exited")


def serve_profile(profile_path: str, overrides: list[str], adapter_args: list[str], *, host: str = DEFAULT_HOST,
                  port: int = DEFAULT_PORT, max_waiting: int = 8, api_key: str | None = None,
                  allow_adapter_loading: bool = False, adapter_root: str | None = None, limits: Limits = Limits(),
                  on_ready=None) -> None:
    """``orbitctl serve``: load the profile, build its engine with the ``--adapter`` values, serve it; ``on_ready``
    gets the :class:`Startup` once the port is bound."""
    from orbitctl.profile import load_profile
    from orbitctl.profile.support import SERVE, given_keys, refuse_unsupported

    _exit_with_parent()
    # every refusal of the options comes before the base is built
    check_exposure(host, api_key)
    access = Access(api_key, AdapterFence.from_options(allow_adapter_loading, adapter_root), limits)
    adapters = [parse_adapter_arg(a) for a in adapter_args]
    for name, path in adapters:  # before the base is built: a typo should not cost a model load
        if not Path(path).is_dir():
            raise UserError(f"--adapter {name}={path}: no such directory",
                            fix="Pass the adapter/ directory of a run (runs/NAME/adapter)")
    profile = load_profile(profile_path, overrides)
    refuse_unsupported(profile, SERVE, given_keys(overrides))
    engine = build_engine(profile, adapters, max_waiting=max_waiting)
    serve(engine, host=host, port=port, access=access, on_ready=on_ready)


@dataclass
class RunningServer:
    """A server on a background thread; ``url`` ends in ``/v1`` (what the ``openai`` client takes)."""

    url: str
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        """Ask the server to finish and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_background(engine: Engine, *, host: str = DEFAULT_HOST, port: int = 0, access: Access = Access(),
                     ready_s: float = 30.0) -> RunningServer:
    """Serve ``engine`` on a thread (port 0: a free one) and return once it accepts connections."""
    check_exposure(host, access.api_key)
    sock = _bind(host, port)
    server = _server(engine, host, sock.getsockname()[1], "error", access)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="orbitctl-serve")
    thread.start()
    deadline = time.monotonic() + ready_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RunFailed(f"the server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.02)
    return RunningServer(f"http://{host}:{sock.getsockname()[1]}/v1", server, thread)
