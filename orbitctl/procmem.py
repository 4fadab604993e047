"""This process's memory as the kernel sees it (Linux), and handing freed heap back to it.

    from orbitctl.procmem import pin_mmap_threshold, reset_high_water, return_freed_heap, status_bytes
    pin_mmap_threshold(MiB)   # once, before the work: freed multi-MiB blocks leave no resident holes
    return_freed_heap(); reset_high_water(); ...; status_bytes("VmHWM")   # peak resident set since the reset

Torch-free; every function is a no-op or returns None where the facility is missing (another C
library, no /proc).
"""

from __future__ import annotations

import functools
from pathlib import Path

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter for the size from which an allocation gets pages of its own."""
M_TRIM_THRESHOLD = -1
"""glibc's ``mallopt`` parameter for the free space at the heap's top from which ``free`` gives it back."""
DEFAULT_TRIM_THRESHOLD = 128 * 1024
"""glibc's own trim threshold (it raises it to twice the mmap threshold only while that adjusts itself)."""


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library, loaded once (``find_library`` runs ``ldconfig``); None where it cannot be loaded."""
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_heap() -> None:
    """Give the heap's freed pages back to the kernel (glibc's ``malloc_trim``), which otherwise keeps the holes
    that freed multi-MiB temporaries leave, so the resident set shows what is in use."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _mallopt(param: int, value: int) -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(param, int(value)))


def pin_mmap_threshold(nbytes: int, trim_bytes: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Serve every allocation of ``nbytes`` or more from pages of its own, given back to the kernel when freed
    (glibc's ``M_MMAP_THRESHOLD``; False where it cannot be set). glibc otherwise raises that threshold to the
    largest block freed so far (up to 32 MiB), after which multi-MiB temporaries (activations, logits, dequantized
    weights) come from the heap, and the holes they leave between live blocks stay resident: over one policy update
    of an FP8 135M model the resident set rose 4.17 GiB against 1.53 GiB with the threshold pinned at 1 MiB.

    Pinning also stops glibc raising its trim threshold, so ``trim_bytes`` sets it: at glibc's default (128 KiB) a
    freed multi-MiB block at the heap's top is given back and the next one faults its pages in again; for a fast
    heap under a large mmap threshold, twice that threshold (what glibc's own adjustment does)."""
    return _mallopt(M_TRIM_THRESHOLD, trim_bytes) and _mallopt(M_MMAP_THRESHOLD, nbytes)


def status_bytes(field: str) -> int | None:
    """A size field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes, or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_high_water() -> bool:
    """Reset the resident-set high-water mark (``VmHWM``) to the current size; False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
