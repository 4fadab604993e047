"""Every collective orbitctl calls, in one place, each on tensors the group's backend takes.

    from orbitctl.dist import collectives as coll
    total = coll.reduce_scalars([tokens], "sum")[0]             # a host number, summed over the ranks
    done = coll.reduce_scalars([int(done)], "min", group)[0]     # over an expert-parallel group

NCCL takes only CUDA tensors: ``deepspeed.init_distributed`` and ``new_group`` make NCCL-only groups on a GPU
node, and a collective over a CPU tensor fails with ``No backend type associated with device type cpu``. A
scalar counted on the host therefore travels on :func:`group_device`: the group's CUDA device where its backend
has no CPU path, the CPU under gloo. The alternative, a default group of ``cpu:gloo,cuda:nccl``, would give host
counters a CPU path on the default group only: every expert-parallel sub-group would need a gloo twin, and a
device value read through gloo still syncs the device first. One rule, the data on the device the backend takes,
holds for every group.

The rest pass device tensors through unchanged and keep gloo's gaps in one place (gloo has no
``all_gather_into_tensor`` for every dtype, and no ``reduce_scatter``). ``tests/test_collectives_only_here.py``
fails if any other module of the package calls a ``torch.distributed`` collective itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

OPS = ("sum", "max", "min")


def active(group: Any = None) -> bool:
    """Whether a collective over ``group`` has other ranks to meet (a process group exists and is larger than 1)."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size(group) > 1


def group_device(group: Any = None) -> "torch.device":
    """The device a tensor of a collective over ``group`` must live on: the CPU where the backend has a CPU path
    (gloo, ``cpu:gloo,cuda:nccl``), else this rank's CUDA device."""
    import torch
    import torch.distributed as dist

    types = _device_types(group)
    if not types or "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _device_types(group: Any = None) -> list[str]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return ["cpu"]
    pg = group if group is not None else dist.group.WORLD
    types = getattr(pg, "_device_types", None)
    if types:
        return [t.type for t in types]
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl", or one backend's name for all its devices
    if ":" in config:
        return [part.split(":")[0] for part in config.split(",")]
    return ["cuda"] if config == "nccl" else ["cpu"]


def _op(name: str):
    import torch.distributed as dist

    if name not in OPS:
        raise ValueError(f"reduce op {name!r}: one of {', '.join(OPS)}")
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[name]


def reduce_scalars(values: "Sequence[float | int]", op: str = "sum", group: Any = None) -> list:
    """``values`` reduced over the ranks of ``group``, element by element, as host numbers (ints stay ints). One
    small tensor on :func:`group_device` and one device-to-host read: call it once per step, not per token."""
    import torch

    values = list(values)
    integral = all(isinstance(v, (int, bool)) for v in values)
    if not active(group):
        return [int(v) for v in values] if integral else [float(v) for v in values]
    # made on the host, then copied: what torch.tensor(..., device=) does, written so a fake device takes it too
    tensor = torch.tensor(values, dtype=torch.int64 if integral else torch.float64).to(group_device(group))
    all_reduce(tensor, op, group)
    return _read(tensor, values, op, group)


def _read(tensor, values: list, op: str, group: Any) -> list:
    """The reduced values on the host. Under the rehearsal's fake tensors there is no value to read: the result is
    what every rank holding the same ``values`` gets (the fake group moves no data)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(tensor):
        scale = dist.get_world_size(group) if op == "sum" else 1
        return [type(v)(v * scale) if not isinstance(v, bool) else v for v in values]
    return tensor.tolist()


def all_reduce(tensor: "torch.Tensor", op: str = "sum", group: Any = None) -> "torch.Tensor":
    """``tensor`` reduced in place over ``group`` (it must already be on :func:`group_device`)."""
    import torch.distributed as dist

    if active(group):
        dist.all_reduce(tensor, op=_op(op), group=group)
    return tensor


def all_gather(x: "torch.Tensor", group: Any = None) -> "torch.Tensor":
    """Every rank's ``x`` (all of one shape) stacked in rank order along the first dimension."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    if dist.get_backend(group) == "gloo":  # gloo has no all_gather_into_tensor for every dtype
        dist.all_gather(list(out.chunk(size)), x, group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter(x: "torch.Tensor", group: Any = None) -> "torch.Tensor":
    """The sum over the ranks of ``x`` [size x N, ...], this rank's N rows of it."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":  # gloo has no reduce_scatter: the whole sum, this rank's rows kept
        whole = x.contiguous()
        dist.all_reduce(whole, group=group)
        return whole.chunk(size)[dist.get_rank(group)].contiguous()
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_to_all(out: "torch.Tensor", x: "torch.Tensor", out_splits: "list[int] | None" = None,
               in_splits: "list[int] | None" = None, group: Any = None, *, grad: bool = False) -> "torch.Tensor":
    """Rows of ``x`` split by ``in_splits`` to each rank, received into ``out`` split by ``out_splits`` (equal
    splits when None); ``grad``: the autograd variant, whose backward sends the gradients back the same way."""
    import torch.distributed as dist

    if grad:
        import warnings

        from torch.distributed.nn.functional import all_to_all_single

        with warnings.catch_warnings():  # deprecated in favour of a private module; still the public autograd one
            warnings.simplefilter("ignore", FutureWarning)
            return all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


def even_split(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` counts that differ by at most one, the larger first: the rehearsal's stand-in for
    a routing it has no values of (every rank, or every expert, an even share)."""
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


def exchange_counts(send: "torch.Tensor", rows: int, group: Any = None) -> tuple[list[int], list[int]]:
    """(rows this rank sends to each rank, rows it receives from each) as host lists: ``send`` [P] counted on the
    device, exchanged by one all-to-all and read by one device-to-host copy of both. ``rows``: how many rows ``send``
    counts in all; under the rehearsal's fake tensors, whose counts have no value, every rank sends them evenly."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import is_fake

    recv = all_to_all(torch.empty_like(send), send, group=group)
    if is_fake(send):
        even = even_split(rows, dist.get_world_size(group))
        return even, list(even)
    both = torch.stack([send, recv]).tolist()
    return both[0], both[1]


def barrier(group: Any = None) -> None:
    """Every rank of ``group`` reaches this point before any goes on (a no-op alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=group)


def gather_objects(obj: Any, group: Any = None) -> list:
    """Every rank's ``obj`` in rank order (pickled; for small host values); ``[obj]`` alone."""
    import torch.distributed as dist

    if not active(group):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_objects(objects: list, src: int = 0, group: Any = None) -> list:
    """``objects`` as rank ``src`` holds them, on every rank (pickled; for small host values)."""
    import torch.distributed as dist

    if active(group):
        dist.broadcast_object_list(objects, src=src, group=group)
    return objects
