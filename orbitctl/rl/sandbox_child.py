"""The sandbox's child process: confine itself, then run a completion and count the tests it passes.

Started by :func:`orbitctl.rl.sandbox.run_tests` as ``python -I -S sandbox_child.py NONCE`` with one
JSON document on stdin. It imports only the standard library (the interpreter runs without
site-packages), applies the limits to itself before the untrusted program is compiled, and
prints the result on a line that starts with the nonce, so the program cannot forge it by
printing. Confinement happens here rather than in a ``preexec_fn`` because the parent may be
multi-threaded: code run between fork and exec there can deadlock on a lock another thread held.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import resource
import sys

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


_CAP_DAC_READ_SEARCH, NOBODY = 2, 65534


def _become_nobody(libc) -> None:
    for cap in range(64):  # the bounding set first: it needs CAP_SETPCAP, which goes next
        if cap != _CAP_DAC_READ_SEARCH:
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS across setuid
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    keep = 1 << _CAP_DAC_READ_SEARCH
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = keep
    libc.capset(ctypes.byref(header), data)
    libc.prctl(47, 2, _CAP_DAC_READ_SEARCH, 0, 0)  # PR_CAP_AMBIENT_RAISE: survives exec


def confine(workdir: str, limits: dict, read_roots: list[str], nproc: int) -> None:
    """Apply every layer the OS allows to this (single-threaded) process; each refusal is skipped."""
    libc = _libc()
    abi = landlock_abi()
    if os.geteuid() == 0:
        libc.unshare(_CLONE_NEWNET)
    else:
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    # the CPU hard limit sits a second above the soft one: the kernel sends SIGXCPU at the soft limit
    # (the parent reports it as a timeout) and SIGKILL at the hard one only to a program that ignores it
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    for limit, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                         (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    if os.geteuid() == 0:
        _become_nobody(libc)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if abi:
        _landlock(workdir, read_roots, abi)


def run(job: dict, nonce: str) -> None:
    """Execute the program, then its tests' setup, then each assert on its own; report passed/total."""
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
        report(0, total); return
    setup = [n for n in tests.body if not (check and n is check[0]) and not (not check and isinstance(n, ast.Assert))]
    try:
        exec(compile(ast.Module(body=setup, type_ignores=[]), "<tests>", "exec"), ns)
        if check:
            ns["candidate"] = ns[job["entry_point"]] if job.get("entry_point") else None
            exec(compile(ast.Module(body=[n for n in check[0].body if not isinstance(n, ast.Assert)], type_ignores=[]), "<check>", "exec"), ns)
    except BaseException:
        report(0, total); return
    if not asserts:  # the checks sit inside loops or helpers: running the body to its end is the one test
        report(1, 1); return
    passed = 0
    for node in asserts:
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), "<assert>", "exec"), ns)
            passed += 1
        except BaseException:
            pass
    report(passed, total)


def main() -> None:
    nonce = sys.argv[1]
    doc = json.loads(sys.stdin.read())
    confine(doc["workdir"], doc["limits"], doc["read_roots"], doc["nproc"])
    run(doc["job"], nonce)


if __name__ == "__main__":
    main()
