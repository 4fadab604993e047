"""Run untrusted completion code in a confined subprocess and count the tests it passes.

Each run gets a fresh temp dir (its cwd and HOME), a scrubbed environment, a wall-clock
timeout (the whole process group is killed), and, applied in the child before the
interpreter starts:
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

import ctypes
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

_RUNNER = r'''
import ast, json, sys
nonce = sys.argv[1]
job = json.loads(sys.stdin.read())
del sys.argv[1:]
ns = {"__name__": "__sandbox__"}
def report(passed, total):
    sys.__stdout__.write("\n" + nonce + json.dumps({"passed": passed, "total": total}) + "\n")
    sys.__stdout__.flush()
tests = ast.parse(job["tests"])
check = [n for n in tests.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
body = check[0].body if check else [n for n in tests.body]
asserts = [n for n in body if isinstance(n, ast.Assert)]
total = max(1, len(asserts))
try:
    exec(compile(job["program"], "<completion>", "exec"), ns)
except BaseException:
    report(0, total); raise SystemExit(0)
setup = [n for n in tests.body if not (check and n is check[0]) and not (not check and isinstance(n, ast.Assert))]
try:
    exec(compile(ast.Module(body=setup, type_ignores=[]), "<tests>", "exec"), ns)
    if check:
        ns["candidate"] = ns[job["entry_point"]] if job.get("entry_point") else None
        exec(compile(ast.Module(body=[n for n in check[0].body if not isinstance(n, ast.Assert)], type_ignores=[]), "<check>", "exec"), ns)
except BaseException:
    report(0, total); raise SystemExit(0)
passed = 0
for node in asserts:
    try:
        exec(compile(ast.Module(body=[node], type_ignores=[]), "<assert>", "exec"), ns)
        passed += 1
    except BaseException:
        pass
report(passed, total)
'''


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
    """ok, timeout, crashed (no result line) or error."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


# --- Landlock (raw syscalls; constants from linux/landlock.h) ------------------------------
_SYS_CREATE, _SYS_ADD, _SYS_RESTRICT = 444, 445, 446
_FS_EXECUTE, _FS_WRITE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ALL_ABI1 = (1 << 13) - 1
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"):
        return 0
    try:
        return max(0, int(_libc().syscall(_SYS_CREATE, None, 0, 1)))
    except Exception:
        return 0


def _landlock(workdir: str, read_roots: list[str], abi: int) -> None:
    libc = _libc()
    fs = _FS_ALL_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0) | (
        _FS_IOCTL_DEV if abi >= 5 else 0)
    attr = _RulesetAttr(fs, 0, (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 8
    ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return
    file_rights = _FS_EXECUTE | _FS_WRITE | _FS_READ_FILE | (_FS_TRUNCATE if abi >= 3 else 0)

    def allow(path: str, rights: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        if not os.path.isdir(path):
            rights &= file_rights
        rule = _PathBeneath(rights, fd)
        libc.syscall(_SYS_ADD, ruleset, 1, ctypes.byref(rule), 0)
        os.close(fd)

    for root in read_roots:
        allow(root, _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR)
    allow(workdir, fs)
    allow("/dev/null", _FS_READ_FILE | _FS_WRITE)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.syscall(_SYS_RESTRICT, ruleset, 0)
    os.close(ruleset)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_CAP_DAC_READ_SEARCH, _NOBODY = 2, 65534


def _become_nobody(libc) -> None:
    for cap in range(64):  # the bounding set first: it needs CAP_SETPCAP, which goes next
        if cap != _CAP_DAC_READ_SEARCH:
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS across setuid
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)
    keep = 1 << _CAP_DAC_READ_SEARCH
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = keep
    libc.capset(ctypes.byref(header), data)
    libc.prctl(47, 2, _CAP_DAC_READ_SEARCH, 0, 0)  # PR_CAP_AMBIENT_RAISE: survives exec


def _process_count(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _confine(workdir: str, limits: SandboxLimits, read_roots: list[str], abi: int, nproc: int) -> None:
    """Runs in the child between fork and exec: only async-signal-tolerant, allocation-light work."""
    libc = _libc()
    if os.geteuid() == 0:
        libc.unshare(_CLONE_NEWNET)
    else:
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    for limit, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_bytes),
                         (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_NOFILE, limits.open_files),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    if os.geteuid() == 0:
        _become_nobody(libc)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if abi:
        _landlock(workdir, read_roots, abi)


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
        os.chown(workdir, _NOBODY, _NOBODY)
    abi, roots = landlock_abi(), _read_roots()
    # RLIMIT_NPROC counts every process of the uid, so the budget sits on top of what already runs
    nproc = _process_count(_NOBODY if os.geteuid() == 0 else os.getuid()) + limits.processes if sys.platform == "linux" else limits.processes
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    job = json.dumps({"program": program, "tests": tests, "entry_point": entry_point})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _RUNNER, nonce], cwd=workdir, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=lambda: _confine(workdir, limits, roots, abi, nproc), close_fds=True)
        try:
            out, _ = proc.communicate(job.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return SandboxResult(0, 1, "timeout")
        finally:
            _kill_group(proc)
        for line in reversed(out.decode("utf-8", "replace").splitlines()):
            if line.startswith(nonce):
                doc = json.loads(line[len(nonce):])
                return SandboxResult(int(doc["passed"]), int(doc["total"]), "ok")
        return SandboxResult(0, 1, "crashed")
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
