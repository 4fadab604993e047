"""Build locks that an interrupted op build left behind, found and removed before DeepSpeed builds its ops.

    from orbitctl.dist.build_locks import clear_stale_build_locks
    removed = clear_stale_build_locks()   # the lock files removed (each logged once), before deepspeed.init_distributed
    stale_build_locks()                   # the same, found only (orbitctl doctor)

DeepSpeed compiles some of its ops at first use through PyTorch's JIT extension builder (on a CPU, its shared-memory
all-reduce, ``deepspeed_shm_comm``, built by ``deepspeed.init_distributed`` in every process). The builder guards each
extension's build directory with a lock file, ``<build root>/<extension>/lock``, created exclusively (``O_CREAT |
O_EXCL``) by the process that builds and removed when it is done, also when the extension is already built. Every other
process waits for that file to disappear, with no timeout (``torch.utils.file_baton.FileBaton.wait``). A build killed
in between (Ctrl-C twice, a rank killed by its launcher, an out-of-memory kill, a CI timeout) leaves the file, and from
then on every ``orbitctl train`` on that machine waits forever, silently, before its first step.

A lock is live while its builder holds it open: the builder keeps the descriptor from creating the file to removing
it. So a lock file that no process on this machine has open, seen twice a moment apart, is stale and is removed (one
warning line names it). Where the processes' descriptors cannot all be read (``/proc`` absent, another user's
processes), a lock is removed only once it is older than :data:`UNREADABLE_STALE_S`, longer than any op build takes.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
"""The name PyTorch's JIT extension builder gives the lock file in each extension's build directory."""
UNREADABLE_STALE_S = 1800.0
"""Age from which a lock is taken for stale where no process's open files can be checked (an op build takes seconds
to minutes)."""
RECHECK_S = 0.2
"""The pause between the two looks at a lock that no process holds (a builder between closing and removing it)."""


def lock_files() -> list[Path]:
    """The build lock files present where PyTorch builds JIT extensions: ``$TORCH_EXTENSIONS_DIR/<extension>/lock``,
    else ``<user cache>/torch_extensions/<python>_<accelerator>/<extension>/lock`` for every Python version and
    accelerator (``py311_cpu``, ``py312_cu130``; the user cache is ``$XDG_CACHE_HOME`` or ``~/.cache``, as PyTorch's)."""
    override = os.environ.get("TORCH_EXTENSIONS_DIR")
    if override is not None:
        root, pattern = Path(override), f"*/{LOCK_NAME}"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root, pattern = Path(cache) / "torch_extensions", f"*/*/{LOCK_NAME}"
    try:
        return sorted(path for path in root.glob(pattern) if path.is_file())
    except OSError:
        return []


def open_by_any_process(path: Path, proc: Path = Path("/proc")) -> bool | None:
    """Whether a process on this machine has ``path`` open: True, False, or None when some process's open files could
    not be read (no ``/proc``, or processes of another user)."""
    try:
        pids = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return None
    target = os.path.realpath(path)
    unreadable = False
    for pid in pids:
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:  # the process ended meanwhile
            continue
        except OSError:
            unreadable = True
            continue
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd) == target:
                    return True
            except OSError:  # closed meanwhile
                continue
    return None if unreadable else False


def is_stale(lock: Path, *, now: float | None = None, proc: Path = Path("/proc")) -> bool:
    """Whether the build lock ``lock`` was left by a build that is no longer running (see the module's docstring)."""
    try:
        identity = lock.stat()
    except FileNotFoundError:
        return False
    held = open_by_any_process(lock, proc)
    if held is None:
        return (now if now is not None else time.time()) - identity.st_mtime >= UNREADABLE_STALE_S
    if held:
        return False
    time.sleep(RECHECK_S)  # a builder that had closed it and was about to remove it has done so by now
    try:
        again = lock.stat()
    except FileNotFoundError:
        return False
    same = (again.st_ino, again.st_dev, again.st_mtime_ns) == (identity.st_ino, identity.st_dev, identity.st_mtime_ns)
    return same and open_by_any_process(lock, proc) is False


def stale_build_locks(locks: list[Path] | None = None, *, proc: Path = Path("/proc")) -> list[Path]:
    """The stale ones of ``locks`` (default :func:`lock_files`): what ``orbitctl doctor`` reports."""
    return [lock for lock in (lock_files() if locks is None else locks) if is_stale(lock, proc=proc)]


def clear_stale_build_locks(locks: list[Path] | None = None, *, proc: Path = Path("/proc")) -> list[Path]:
    """Remove the stale ones of ``locks`` (default :func:`lock_files`); the paths removed, each logged as a warning."""
    removed = []
    for lock in stale_build_locks(locks, proc=proc):
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        except OSError as err:
            log.warning("a build lock no process holds could not be removed (%s): %s; an op build will wait on it "
                        "forever: remove it by hand", err, lock)
            continue
        log.warning("removed a build lock that an interrupted op build left (no process holds it): %s", lock)
        removed.append(lock)
    return removed
