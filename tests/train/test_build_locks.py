"""A lock file that a killed op build left must not keep train waiting forever (orbitctl/dist/build_locks.py).

PyTorch's JIT extension builder waits without a timeout for ``<build root>/<extension>/lock`` to disappear, and
``deepspeed.init_distributed`` builds (or re-checks) its shared-memory op through it in every process: one killed
build left the file and every later ``orbitctl train`` on the machine hung before its first step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orbitctl.dist import build_locks
from orbitctl.dist.build_locks import (UNREADABLE_STALE_S, clear_stale_build_locks, is_stale, lock_files,
                                       open_by_any_process)

HOLD = "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(120)"


def _lock(root: Path, extension: str = "deepspeed_shm_comm") -> Path:
    lock = root / extension / build_locks.LOCK_NAME
    lock.parent.mkdir(parents=True)
    return lock


def test_a_lock_no_process_holds_is_removed_and_named(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path)
    lock.touch()
    (tmp_path / "other_ext").mkdir()  # a build directory without a lock is left alone
    assert open_by_any_process(lock) is False
    with caplog.at_level("WARNING", logger=build_locks.__name__):
        assert clear_stale_build_locks() == [lock]
    assert not lock.exists() and (tmp_path / "other_ext").is_dir()
    assert str(lock) in caplog.text


def test_a_lock_a_live_build_holds_is_kept_until_that_process_ends(tmp_path):
    lock = _lock(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert open_by_any_process(lock) is True
        assert clear_stale_build_locks([lock]) == [] and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_build_locks([lock]) == [lock] and not lock.exists()


def test_without_readable_open_files_only_an_old_lock_counts_as_stale(tmp_path):
    fake_proc = tmp_path / "proc"
    (fake_proc / "1").mkdir(parents=True)  # a process whose open files cannot be listed (no fd directory readable)
    (fake_proc / "1" / "fd").write_text("")  # a file where the directory should be: listing it fails
    lock = _lock(tmp_path / "root")
    lock.touch()
    assert open_by_any_process(lock, proc=fake_proc) is None
    assert not is_stale(lock, proc=fake_proc)
    old = time.time() - UNREADABLE_STALE_S - 60
    os.utime(lock, (old, old))
    assert is_stale(lock, proc=fake_proc)
    assert clear_stale_build_locks([lock], proc=fake_proc) == [lock]


def test_the_locks_looked_at_are_where_torch_builds(tmp_path, monkeypatch):
    """``$TORCH_EXTENSIONS_DIR/<extension>/lock``, else every ``torch_extensions/<python>_<accelerator>/<extension>``
    of the user cache (``$XDG_CACHE_HOME``, as PyTorch's cache directory)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    direct = _lock(tmp_path / "ext")
    direct.touch()
    assert lock_files() == [direct]
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu = _lock(tmp_path / "cache" / "torch_extensions" / "py311_cpu")
    cuda = _lock(tmp_path / "cache" / "torch_extensions" / "py312_cu130", "cpu_adam")
    cpu.touch()
    cuda.touch()
    assert lock_files() == sorted([cpu, cuda])
    from torch.utils.cpp_extension import get_default_build_root

    assert Path(get_default_build_root()) == tmp_path / "cache" / "torch_extensions"  # PyTorch's own answer


@pytest.mark.slow
def test_the_process_group_starts_past_a_lock_a_killed_build_left(tmp_path):
    """What hung: DeepSpeed's init on the CPU builds its shared-memory op through the JIT builder's lock. With a stale
    lock planted in the build directory, the group still starts. Where this interpreter has built the op already (the
    suite's first train does), the build directory starts as a copy of it: the builder still takes the lock and runs
    its build, which then finds everything up to date (4 s instead of 30 on two cores)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = _lock(tmp_path)
    built = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    if (built / "deepspeed_shm_comm.so").exists() and not (built / build_locks.LOCK_NAME).exists():
        shutil.copytree(built, lock.parent, dirs_exist_ok=True)
    lock.touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    code = ("from orbitctl.rl.engine import close_process_group, ensure_process_group\n"
            "print('group', *ensure_process_group(), flush=True)\nclose_process_group()\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group 0 1" in done.stdout
    assert f"removed a build lock that an interrupted op build left (no process holds it): {lock}" in done.stderr
    assert not lock.exists()
