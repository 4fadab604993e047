"""Read the numbers inside a CUDA/HIP out-of-memory message and decide why it happened.

Fragmentation, capacity or another process is decided from the sizes, not from keywords
(the message suggests expandable_segments even when it is already on):
  request > total                                  -> capacity (one tensor larger than the GPU)
  listed other processes' memory >= request        -> another process
  memory outside this process >= max(request, 10%) -> another process
  reserved-but-unallocated >= request              -> fragmentation (unless PyTorch holds >= 90% of the GPU)
  free >= request                                  -> fragmentation (free memory not contiguous)
  otherwise                                        -> capacity
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from orbitctl.doctor.signatures import OOM_PARTS
from orbitctl.units import BYTE_UNITS, GiB, KiB, MiB, TiB, gib

# the suffixes a user may write, plus the two that only allocator messages use
_UNITS = {**{suffix.lower(): size for suffix, size in BYTE_UNITS.items()}, "bytes": 1, "pib": KiB * TiB}


def parse_size(text: str | None) -> int | None:
    """'2.26 GiB' -> bytes; None when unreadable."""
    if not text:
        return None
    m = re.match(r"([\d.]+) ?([A-Za-z]+)", text.strip())
    if not m:
        return None
    try:
        return int(float(m.group(1)) * _UNITS.get(m.group(2).lower(), 0)) if m.group(2).lower() in _UNITS else None
    except ValueError:
        return None


@dataclass
class OomDetails:
    kind: str = "unknown"
    """frag | cap | peer | unknown (no numbers in the message)."""
    form: str | None = None
    """current | 2.1 | old (torch <= 2.0) | limit ('would exceed allowed memory') | hip."""
    gpu: int | None = None
    request: int | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    private_pools: int | None = None
    this_process: int | None = None
    allowed: int | None = None
    """The process's own cap (torch.cuda.set_per_process_memory_fraction), when the message states one."""
    peers: dict[int, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def peer_bytes(self) -> int:
        return sum(self.peers.values())


def _g(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{gib(n)} GiB" if n >= GiB / 4 else f"{n / MiB:.0f} MiB"


def parse_oom(text: str) -> OomDetails:
    """Pull every number out of one OOM message (the lines around the match, joined)."""
    d = OomDetails()
    if m := OOM_PARTS["oom.req"].search(text):
        d.request = parse_size(m.group("req"))
    if m := OOM_PARTS["oom.cap"].search(text):
        d.gpu = int(m.group("g")) if m.group("g") else None
        d.total, d.free = parse_size(m.group("tot")), parse_size(m.group("free"))
        d.form = "2.1" if "capacty" in m.group(0) else "current"
        if m2 := OOM_PARTS["oom.allowed"].search(text):
            d.allowed = parse_size(m2.group("allowed"))
        if m2 := OOM_PARTS["oom.frag"].search(text):
            d.reserved_unallocated = parse_size(m2.group("un"))
        if m2 := OOM_PARTS["oom.alloc"].search(text):
            d.allocated = parse_size(m2.group("a"))
        if m2 := OOM_PARTS["oom.pool"].search(text):
            d.private_pools = parse_size(m2.group("p"))
        if m2 := OOM_PARTS["oom.self"].search(text):
            d.this_process = parse_size(m2.group("m"))
        for m2 in OOM_PARTS["oom.peer"].finditer(text):
            size = parse_size(m2.group("m"))
            if size is not None:
                d.peers[int(m2.group("pid"))] = size
    elif m := OOM_PARTS["oom.limit"].search(text):
        d.form = "limit"
        d.request, d.total, d.free = parse_size(m.group("req")), parse_size(m.group("tot")), parse_size(m.group("free"))
        d.allocated = parse_size(m.group("alloc"))
        if g := re.search(r"on device (\d+) would exceed", text):
            d.gpu = int(g.group(1))
    elif m := OOM_PARTS["oom.old"].search(text):
        d.form = "old"
        d.gpu, d.total, d.free = int(m.group("g")), parse_size(m.group("tot")), parse_size(m.group("free"))
        d.allocated = parse_size(m.group("alloc"))
        reserved = parse_size(m.group("res"))
        if reserved is not None and d.allocated is not None:
            d.reserved_unallocated = max(0, reserved - d.allocated)
            d.this_process = reserved
    _own_pid_listed_as_peer(d)
    _apply_process_cap(d)
    if "HIP out of memory" in text:
        d.form = "hip"
    decide(d)
    return d


def _own_pid_listed_as_peer(d: OomDetails) -> None:
    """In a container the allocator cannot match its own PID and lists itself as 'Process N has M'.

    With no 'this process has' entry, the listed process that holds at least everything
    PyTorch reserved is this process, not another one.
    """
    if d.this_process is not None or d.allocated is None or not d.peers:
        return
    reserved = d.allocated + (d.reserved_unallocated or 0) + (d.private_pools or 0)
    pid, size = max(d.peers.items(), key=lambda kv: kv[1])
    if size >= reserved:
        d.this_process = d.peers.pop(pid)
        d.reasons.append(f"pid {pid} holds everything PyTorch reserved: it is this process (PID namespace)")


def _apply_process_cap(d: OomDetails) -> None:
    """Under a memory fraction the process's cap, not the GPU, is the capacity it ran out of.

    'GPU 0 has a total capacity of 288 GiB of which 276 GiB is free. 1.05 GiB allowed;' is a
    full cap, not free memory that is fragmented: the cap becomes the total and what PyTorch
    has reserved comes out of it.
    """
    if d.allowed is None or d.total is None or d.allowed >= d.total:
        return
    reserved = (d.allocated or 0) + (d.reserved_unallocated or 0)
    d.reasons.append(f"the process is capped at {_g(d.allowed)} of the GPU's {_g(d.total)} "
                     "(set_per_process_memory_fraction)")
    # what is left under the cap is smaller than the allocator's next segment (2 or 20 MiB) whenever
    # the cap was hit, so it is no evidence of fragmentation: only reserved-but-unallocated is
    d.reasons.append(f"PyTorch has reserved {_g(reserved)} of it")
    d.total, d.free = d.allowed, None
    d.peers.clear()  # other processes' memory lies outside the cap


def decide(d: OomDetails) -> None:
    """Set d.kind and d.reasons from the numbers."""
    req, tot, r = d.request, d.total, d.reserved_unallocated
    if req is None or tot is None:
        d.kind = "unknown" if req is None else "cap"
        d.reasons.append(f"asked for {_g(req)}; the message gives no GPU totals")
        return
    d.reasons.append(f"GPU {'?' if d.gpu is None else d.gpu}: asked for {_g(req)} with {_g(d.free)} free of {_g(tot)}")
    if d.allocated is not None:
        d.reasons.append(f"PyTorch: {_g(d.allocated)} allocated, {_g(r)} reserved but unallocated"
                         + (f", {_g(d.private_pools)} in private pools" if d.private_pools else ""))
    if req > tot:
        d.kind = "cap"
        d.reasons.append(f"a single allocation of {_g(req)} is larger than the whole GPU ({_g(tot)})")
        return
    used_by_torch = (d.allocated or 0) + (d.private_pools or 0)
    nearly_full = d.allocated is not None and used_by_torch >= 0.90 * tot
    if d.peers and d.peer_bytes >= req:
        d.kind = "peer"
        listed = ", ".join(f"pid {p}: {_g(b)}" for p, b in d.peers.items())
        d.reasons.append(f"other processes hold {_g(d.peer_bytes)} on this GPU ({listed}) >= request {_g(req)}")
        return
    mine = d.this_process
    if mine is None and d.allocated is not None:
        mine = used_by_torch + (r or 0)
    # what the cache holds must be known (reserved, or this process's total) before the rest is
    # blamed on another process; the 'exceeds allowed memory' form gives only allocated bytes
    if mine is not None and d.free is not None and (d.this_process is not None or r is not None):
        unexplained = tot - d.free - mine - d.peer_bytes
        if unexplained >= max(req, 0.10 * tot) and unexplained > (r or 0):
            d.kind = "peer"
            d.reasons.append(f"{_g(unexplained)} of the GPU is used outside this process (another process or "
                             "container holds it)")
            return
    if r is not None and r >= req and nearly_full:
        d.reasons.append(f"reserved-but-unallocated {_g(r)} could hold the request, but PyTorch has allocated "
                         f"{used_by_torch / tot:.0%} of the GPU: capacity first, fragmentation second")
    elif r is not None and r >= req:
        d.kind = "frag"
        d.reasons.append(f"reserved-but-unallocated {_g(r)} >= request {_g(req)}: the cache holds enough memory, "
                         "but not in one block (fragmentation)")
        return
    if d.free is not None and d.free >= req:
        d.kind = "frag"
        d.reasons.append(f"{_g(d.free)} free >= request {_g(req)} yet the allocation failed: free memory is not contiguous")
        return
    d.kind = "cap"
    d.reasons.append(f"this process uses {_g(mine if mine is not None else d.allocated)} of {_g(tot)}: "
                     "the run needs more memory than the GPU has")


FIX_BY_KIND = {
    "frag": ("Fragmentation: export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the message suggests it even when it "
             "is already set: if it is, keep shapes fixed, e.g. pad to memory.seq_len, and lower memory.micro_batch_size)"),
    "peer": ("Another process holds memory on this GPU: stop it (`nvidia-smi --query-compute-apps=pid,used_memory "
             "--format=csv`, then kill <pid>); give each rank its own GPU: torch.cuda.set_device(local_rank) before any CUDA "
             "call (every rank on cuda:0 is the classic cause), or CUDA_VISIBLE_DEVICES"),
}
