"""The CUDA rehearsal: the GPU paths run on a CPU-only torch, on ``cuda`` tensors that hold no data, under an
8-rank process group that takes CUDA tensors only, as NCCL does.

    with rehearsal(world=8, rank=0) as r:          # FakeTensorMode + a cuda-only fake group + the guards
        model = build(...).to("cuda")               # nothing is allocated: shapes, dtypes and devices only
        with r.capturable("decode step"):           # a host read or data-dependent shape here fails
            step(...)
    r.collectives                                   # what crossed the group: op, dtype, shape, caller

What it catches, each named by the file and line of the call that did it (:class:`RehearsalError`):

- a collective over a tensor the group's backend does not take: a CPU tensor in an all-reduce fails here as
  it fails under NCCL (``No backend type associated with device type cpu``), including through
  :mod:`orbitctl.dist.collectives`, whose frames are skipped so the caller is named;
- a CPU tensor mixed into a CUDA op (beyond the 0-dimensional scalars CUDA ops take);
- inside :meth:`Rehearsal.capturable`, an op a CUDA graph cannot capture: a value read by the host
  (``.item()``, ``bool()``, ``.tolist()``), a device-to-host copy, or an op whose output shape depends on the data
  (``nonzero``, a boolean-mask index, ``masked_select``, ``unique``);
- anywhere, an op whose output is sized by the data (fake tensors cannot size it; on a GPU it is a sync).

Outside captured regions a host read of a fake value is answered (False, 1, 1.0) and counted by call site
(:attr:`_Guard.host_reads`: each a sync on a GPU). On a CPU-only torch the tensors need the fake CUDA device guard
and hooks of :mod:`orbitctl.dist.fake_cuda`, loaded before torch: run it through ``python -m orbitctl.launch.rehearse``.

What it cannot see: values (a fake tensor has none: sampling decisions, a router's choices, numerics), a real
graph capture (the CUDA caching allocator and stream rules), NCCL's own behaviour (hangs, transport), and code that
reads device properties of a real GPU. ``benchmarks/device_check.py`` covers those on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

BACKEND = "rehearsal"
"""The fake process group's backend name, registered for the ``cuda`` device only."""

_HERE = os.path.dirname(os.path.abspath(__file__))
_PLUMBING = tuple(os.path.join(_HERE, name) for name in ("collectives.py", "rehearsal.py"))
"""The frames call_site skips: the helper every collective goes through, and this module."""
_TORCH = None


class RehearsalError(RuntimeError):
    """A GPU-path defect the rehearsal caught; ``where`` is ``file:line`` of the call that did it."""

    def __init__(self, kind: str, detail: str, where: str) -> None:
        super().__init__(f"{kind} at {where}: {detail}")
        self.kind, self.detail, self.where = kind, detail, where


def _torch_dir() -> str:
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = os.path.dirname(os.path.abspath(torch.__file__))
    return _TORCH


def call_site() -> str:
    """``file:line`` of the innermost frame on the stack that is neither torch's nor the plumbing's
    (:mod:`orbitctl.dist.collectives`, this module): the code that made the call."""
    skip = (_torch_dir(), *_PLUMBING, os.path.dirname(contextlib.__file__))
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith("<"):
            continue
        path = os.path.abspath(frame.filename)
        if not path.startswith(skip) and "/site-packages/" not in path:
            return f"{_short(path)}:{frame.lineno}"
    return "unknown"


def _short(path: str) -> str:
    """A path from the repository's or the package's root where it lies under one, else as given."""
    root = os.path.dirname(os.path.dirname(_HERE))  # the directory holding the orbitctl package
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def _backend_creator(common, options):
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)


def register_backend() -> None:
    """Register the ``rehearsal`` backend (once per process): a fake group that moves no data and takes only
    ``cuda`` tensors."""
    import torch.distributed as dist

    if getattr(dist.Backend, BACKEND.upper(), None) is None:
        dist.Backend.register_backend(BACKEND, _backend_creator, extended_api=True, devices=["cuda"])


@dataclass
class Collective:
    op: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    where: str


# ops whose output shape depends on the data, or that read a value on the host: none can be captured in a CUDA graph
_DATA_SHAPED = {"nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                "unique_dim", "repeat_interleave", "bincount", "histc"}
_HOST_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "allclose"}
# c10d ops whose tensors the group does not receive from the caller (the barrier's dummy is made inside torch)
_OWN_TENSORS = {"barrier", "monitored_barrier_"}


def _tensors(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Guard:
    """The dispatch mode's checks; a class apart from the mode so the mode can be built lazily (torch import)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.collectives: list[Collective] = []
        self.capturing: str | None = None
        self.syncs: list[tuple[str, str]] = []
        self.host_reads: dict[str, int] = {}
        """Device values read by the host outside a captured region (each a sync on a GPU), by call site."""

    def before(self, func, args, kwargs) -> None:
        import torch

        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        flat = _tensors(list(args) + list((kwargs or {}).values()))
        if namespace == "c10d" and name not in _OWN_TENSORS:
            where = call_site()
            wrong = [t for t in flat if t.device.type != self.device_type]
            if wrong:
                raise RehearsalError(
                    "host tensor in a collective", f"{name} over a {wrong[0].device.type} tensor "
                    f"{tuple(wrong[0].shape)} on a group whose backend takes {self.device_type} only "
                    f"(under NCCL: No backend type associated with device type {wrong[0].device.type}); pass it "
                    "through orbitctl.dist.collectives, which puts it on the group's device", where)
            self.collectives.append(Collective(name, tuple(str(t.dtype) for t in flat),
                                               tuple(tuple(t.shape) for t in flat), where))
            return
        if self.capturing is None:
            return
        reason = None
        if name in _HOST_READS:
            reason = f"{name} reads a device value on the host (a sync)"
        elif name in _DATA_SHAPED:
            reason = f"{name}'s output shape depends on the data"
        elif name in ("index", "_index_put_impl_", "index_put", "index_put_") and any(
                t is not None and isinstance(t, torch.Tensor) and t.dtype == torch.bool
                for t in _tensors(list(args[1:2]))):
            reason = "a boolean-mask index (its output shape depends on the data)"
        elif name in ("_to_copy", "copy_", "to") and flat and self._to_host(func, args, kwargs, flat):
            reason = "a device-to-host copy (a sync)"
        if reason is not None:
            where = call_site()
            self.syncs.append((reason, where))
            raise RehearsalError(f"not capturable in {self.capturing}", reason, where)

    def stand_in(self, tensor):
        """What a host read of a fake tensor returns outside a captured region: a CPU value is read with no sync, a
        device value with one (counted by call site, :attr:`host_reads`); either way the rehearsal has no value, and
        reads False for a bool, 1 for an integer, 1.0 for a float (a flag not yet set, a count of one)."""
        import torch

        site = call_site()
        if tensor.device.type != "cpu":
            self.host_reads[site] = self.host_reads.get(site, 0) + 1
        if tensor.dtype == torch.bool:
            return False
        return 1.0 if tensor.is_floating_point() else 1

    def _to_host(self, func, args, kwargs, flat) -> bool:
        import torch

        name = func._schema.name.split("::")[-1]
        if name == "copy_":
            return args[0].device.type == "cpu" and args[1].device.type == self.device_type
        target = (kwargs or {}).get("device")
        return target is not None and torch.device(target).type == "cpu" and flat[0].device.type == self.device_type


def _mode_class():
    import torch
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorDeviceMismatchError, is_fake
    from torch.utils._python_dispatch import TorchDispatchMode

    class GuardMode(TorchDispatchMode):
        def __init__(self, guard: _Guard) -> None:
            super().__init__()
            self.guard = guard

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.guard.before(func, args, kwargs)
            if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
                return self.guard.stand_in(args[0])
            if func is torch.ops.aten.equal.default and any(is_fake(a) for a in args):
                self.guard.stand_in(args[0])
                return True  # torch.equal: a value read too; the rehearsal's answer is that they are
            try:
                return func(*args, **(kwargs or {}))
            except FakeTensorDeviceMismatchError as error:
                raise RehearsalError("host tensor in a device op", f"{func}: {error}", call_site()) from None
            except DynamicOutputShapeException:
                raise RehearsalError(
                    "data-dependent shape", f"{func}'s output is sized by the data, which fake tensors do not have "
                    "(on a GPU: a sync to read the size); a static shape (torch.where, scatter_add_) rehearses",
                    call_site()) from None

    return GuardMode


@dataclass
class Rehearsal:
    world: int
    rank: int
    device: Any
    guard: _Guard
    fake_mode: Any
    notes: list[str] = field(default_factory=list)

    @property
    def collectives(self) -> list[Collective]:
        return self.guard.collectives

    @contextlib.contextmanager
    def capturable(self, what: str):
        """Inside: an op a CUDA graph cannot capture fails with the file and line that ran it."""
        previous, self.guard.capturing = self.guard.capturing, what
        try:
            yield
        finally:
            self.guard.capturing = previous


@contextlib.contextmanager
def _cuda_shims(device_count: int):
    """``torch.cuda``'s Python functions, which a CPU-only build refuses, answered as on a node of one GPU per rank:
    the device queries, and streams and events through torch's device-generic ones (the fake CUDA guard of
    :mod:`orbitctl.dist.fake_cuda` makes, records and waits on them at once). Graphs, memory statistics and anything
    that needs a real device still fail."""
    import torch

    def stream(device=None, priority: int = 0):
        return torch.Stream(device="cuda" if device is None else torch.device(device), priority=priority)

    shims = {
        "is_available": lambda: True,
        "device_count": lambda: device_count,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: torch.Stream(device="cuda"),
        "default_stream": lambda device=None: torch.Stream(device="cuda"),
        "Stream": stream,
        "stream": lambda s: contextlib.nullcontext(s),
        "Event": lambda enable_timing=False, blocking=False, interprocess=False: torch.Event(
            device="cuda", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess),
    }
    saved = {name: getattr(torch.cuda, name) for name in shims}
    record_stream = torch.Tensor.record_stream

    for name, value in shims.items():
        setattr(torch.cuda, name, value)
    torch.Tensor.record_stream = lambda self, s: None  # the caching allocator's bookkeeping: none on a fake device
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        torch.Tensor.record_stream = record_stream


def _fake_mode_class(base):
    class RehearsalFakeMode(base):
        """A fake mode that never moves a constant (a tensor torch.tensor() made) to the device for real: under the
        shims torch.cuda.is_available() answers True, which would let it try."""

        @property
        def avoid_device_init(self) -> bool:
            return True

    return RehearsalFakeMode


@contextlib.contextmanager
def rehearsal(world: int = 8, rank: int = 0, *, cuda_shims: bool = True):
    """The default process group as a ``world``-rank fake group that takes ``cuda`` tensors only (this process is
    ``rank``), fake tensors for every tensor made inside, and the guards; everything is undone on exit."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; the rehearsal makes its own")
    register_backend()
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world)
    guard = _Guard("cuda")
    fake = _fake_mode_class(FakeTensorMode)(allow_non_fake_inputs=True)
    # Module.to() swaps a fake parameter's payload with the converted one (torch.utils.swap_tensors), which a fake
    # tensor that the fake mode holds a weak reference to refuses: the parameter takes the converted data instead
    swap = torch.utils.swap_tensors

    def swap_or_set(t1, t2):
        try:
            swap(t1, t2)
        except RuntimeError:
            if not (is_fake(t1) or is_fake(t2)):
                raise
            t1.data = t2.data
            t1.fake_device = t2.fake_device  # a fake tensor keeps its device beside its (meta) data

    torch.utils.swap_tensors = swap_or_set
    try:
        with contextlib.ExitStack() as stack:
            if cuda_shims:
                stack.enter_context(_cuda_shims(world))
            stack.enter_context(fake)
            stack.enter_context(_mode_class()(guard))
            yield Rehearsal(world, rank, torch.device("cuda", 0), guard, fake)
    finally:
        torch.utils.swap_tensors = swap
        dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m orbitctl.dist.rehearsal
    with rehearsal() as r:
        import torch

        from orbitctl.dist import collectives

        print(collectives.reduce_scalars([1.0, 2.0]), collectives.group_device())
    print(r.collectives, file=sys.stderr)
