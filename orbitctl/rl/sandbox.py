"""Run untrusted completion code in a confined subprocess and count the tests it passes.

Each run gets a fresh temp dir (its cwd and HOME), a scrubbed environment, a wall-clock
timeout (the whole process group is killed), and, applied by the child to itself
(:mod:`orbitctl.rl.sandbox_child`) before the completion is compiled:
  * rlimits: CPU seconds, address space, processes, file size, open files, no core dumps;
  * a new network namespace (no interface but a down loopback) where the kernel allows it;
  * when running as root, the uid of ``nobody`` with one capability kept (reading and
    traversing directories, so an interpreter under /root still starts; Landlock narrows what
    is read): the kernel exempts uid 0 from the process limit, so a fork bomb needs this;
  * Landlock (Linux >= 5.13): writes only beneath the temp dir, reads only from the system
    and interpreter directories, no signals or abstract sockets outside the sandbox.
Each layer that the OS refuses is skipped and reported in :func:`sandbox_capabilities`.
The sandbox contains the code; it does not stop a completion from gaming its own tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orbitctl.isolated import signal_death
from orbitctl.rl.sandbox_child import NOBODY, landlock_abi

_CHILD = str(Path(__file__).with_name("sandbox_child.py"))


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 1024**2
    processes: int = 32
    file_bytes: int = 16 * 1024**2
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    passed: int
    total: int
    status: str
    """ok, timeout (wall clock or CPU seconds), crashed (no result line) or error."""
    detail: str | None = None
    """Why it crashed: the signal that ended the child and its likely cause, or its exit code."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _process_count(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _read_roots() -> list[str]:
    roots = {"/usr", "/lib", "/lib64", "/bin", "/etc", sys.base_prefix, sys.prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(r for r in roots if os.path.exists(r))


def sandbox_capabilities() -> dict:
    """Which containment layers this machine provides (shown in docs and the run log)."""
    return {"landlock_abi": landlock_abi(), "root_runs_as_nobody": os.geteuid() == 0,
            "network_namespace": shutil.which("unshare") is not None or os.geteuid() == 0}


def run_tests(program: str, tests: str, entry_point: str | None = None,
              limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Execute ``program`` then each assert of ``tests`` (HumanEval ``check(candidate)`` or top-level)."""
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="orbitctl-sandbox-")
    if os.geteuid() == 0:
        os.chown(workdir, NOBODY, NOBODY)
    # RLIMIT_NPROC counts every process of the uid, so the budget sits on top of what already runs
    nproc = _process_count(NOBODY if os.geteuid() == 0 else os.getuid()) + limits.processes if sys.platform == "linux" else limits.processes
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    doc = json.dumps({"workdir": workdir, "limits": dataclasses.asdict(limits), "read_roots": _read_roots(),
                      "nproc": nproc, "job": {"program": program, "tests": tests, "entry_point": entry_point}})
    try:
        # no preexec_fn: the caller may run several sandboxes from threads, and Python code run
        # between fork and exec can deadlock on a lock (the dynamic loader's) another thread held
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _CHILD, nonce], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            close_fds=True)
        try:
            out, _ = proc.communicate(doc.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return SandboxResult(0, 1, "timeout")
        finally:
            _kill_group(proc)
        for line in reversed(out.decode("utf-8", "replace").splitlines()):
            if line.startswith(nonce):
                doc = json.loads(line[len(nonce):])
                return SandboxResult(int(doc["passed"]), int(doc["total"]), "ok")
        # out of CPU seconds is the same verdict as out of wall-clock time, whichever came first
        if proc.returncode == -signal.SIGXCPU:
            return SandboxResult(0, 1, "timeout")
        return SandboxResult(0, 1, "crashed", signal_death("the sandboxed program", proc.returncode)
                             or f"the sandboxed program exited with code {proc.returncode} before its result line")
    except OSError:
        return SandboxResult(0, 1, "error")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
