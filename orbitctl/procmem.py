"""This process's memory as the kernel sees it (Linux), and handing freed heap back to it.

    from orbitctl.procmem import reset_high_water, return_freed_heap, status_bytes
    return_freed_heap(); reset_high_water(); ...; status_bytes("VmHWM")   # peak resident set since the reset

Torch-free; every function is a no-op or returns None where the facility is missing (another C
library, no /proc).
"""

from __future__ import annotations

from pathlib import Path

_MALLOC_TRIM = None


def return_freed_heap() -> None:
    """Give the heap's freed pages back to the kernel (glibc's ``malloc_trim``), which otherwise keeps the holes
    that freed multi-MiB temporaries leave, so the resident set shows what is in use."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes
            import ctypes.util

            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


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
