"""Native code run in a child process, so that its crash fails one call, not the caller.

    from orbitctl.isolated import NativeCrash, run_isolated
    scores = run_isolated(llama_cpp_scores, path, seqs, what="llama.cpp", timeout=1800, sigill_fix=FIX)

A native library that executes an instruction the CPU or the kernel refuses (a llama.cpp wheel built with
``-march=native`` on another machine: AVX-512, AMX tile instructions without the kernel's tile-data
permission; a kernel whose AVX-512 registers the OS did not enable) dies with SIGILL, and takes the Python
process that loaded it down with it: no exception, no ``finally``, and under pytest every test after it never
runs (issue 42). :func:`run_isolated` calls ``function(*args, **kwargs)`` in a fresh interpreter (``python -m
orbitctl.isolated``, not a fork: the caller's OpenMP and torch threads do not survive a fork) and returns its
result; the arguments and the result travel as pickles through files. What can happen:

* the function returns: its result;
* it raises: the same exception is raised here (its traceback text in ``child_traceback``);
* the child dies by a signal: :class:`NativeCrash`, one line naming the signal and its likely cause
  ("llama.cpp died with SIGILL (illegal instruction): a native build for another CPU ..."); SIGILL exits 2
  like bad input (the fix is a rebuild, the user's; the caller names it, ``sigill_fix``), other signals 1;
* it runs past ``timeout``: the child is killed and :class:`NativeCrash` says so.

Its callers: llama.cpp (:mod:`orbitctl.export.llamacpp`) and the first calls of orbitctl's own CPU kernels
(:mod:`orbitctl.kernels.bf16_cpu`). A caller that starts a child of its own (the code sandbox) words its death by a
signal with the same table (:func:`signal_death`).

The child loads the function by module name, or from its file when the module cannot be imported by name
(a test file, a script run as ``__main__``); it enables :mod:`faulthandler`, so its stderr (kept, its last
lines in ``NativeCrash.stderr_tail``) shows the Python stack that called into the library. Importing this
module imports no torch.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from orbitctl.errors import EXIT_BAD_INPUT, EXIT_FAILED, OrbitError

# what each fatal signal says about a native library that died of it: (what the signal is, its likely cause)
SIGNAL_CAUSES: dict[int, tuple[str, str]] = {
    signal.SIGILL: ("illegal instruction",
                    "a native build for another CPU: compiled for the machine that built it (GGML_NATIVE / -march=native: "
                    "AVX-512, AMX) or a wheel reused from a pip cache another CPU filled, AMX tile instructions "
                    "without the kernel's tile-data permission, or AVX-512 registers the OS did not enable (XCR0)"),
    signal.SIGSEGV: ("segmentation fault", "a memory error inside the library: a malformed input file, or shared "
                                           "libraries that do not match their Python bindings"),
    signal.SIGBUS: ("bus error", "a memory-mapped file changed or shrank while it was read (the model file rewritten "
                                 "under it), or /dev/shm full"),
    signal.SIGABRT: ("aborted", "the library stopped itself on a failed check (GGML_ASSERT, std::terminate): its last "
                                "stderr line says which"),
    signal.SIGFPE: ("arithmetic exception", "an integer division by zero inside the library"),
    signal.SIGKILL: ("killed", "by the kernel's out-of-memory killer or by another process"),
}


class NativeCrash(OrbitError):
    """The child running native code died by a signal (or ran past its timeout): one line, the signal and its cause."""

    def __init__(self, what: str, signum: int | None, *, stderr_tail: str = "", timeout: float | None = None,
                 sigill_fix: str | None = None) -> None:
        self.what = what
        self.signum = signum
        self.stderr_tail = stderr_tail
        if signum is None:
            self.signame, self.description = "timeout", f"did not finish in {timeout:g} s"
            message, fix = f"{what} did not finish in {timeout:g} s and was killed", None
        else:
            try:
                self.signame = signal.Signals(signum).name
            except ValueError:
                self.signame = f"signal {signum}"
            self.description, cause = SIGNAL_CAUSES.get(signum, (self.signame, "a fatal signal inside the library"))
            message = f"{what} died with {self.signame} ({self.description}): {cause}"
            reason = _abort_reason(stderr_tail) if signum == signal.SIGABRT else ""
            if reason:
                message += f" ({reason})"
            fix = sigill_fix if signum == signal.SIGILL else None
        self.exit_code = EXIT_BAD_INPUT if signum == signal.SIGILL else EXIT_FAILED
        super().__init__(message, fix=fix)


_FAULTHANDLER = ("Fatal Python", "  File", "Current thread", "Thread 0x", "Extension modules")


def _last_line(text: str) -> str:
    """The child's last line of output that is not faulthandler's stack dump."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(_FAULTHANDLER)]
    return lines[-1][:200] if lines else ""


def _abort_reason(text: str) -> str:
    """The line of an abort's stderr that says why: a failed GGML_ASSERT, std::terminate's, else the last line."""
    for line in reversed(text.splitlines()):
        if any(key in line for key in ("GGML_ASSERT", "GGML_ABORT", "terminate called", "Assertion")):
            return line.strip()[:200]
    return _last_line(text)


def _locate(function: Callable) -> tuple[str, str | None, str]:
    """(module name, its file or None, qualified name) of a module-level function."""
    module = sys.modules.get(function.__module__)
    path = getattr(module, "__file__", None)
    if "<locals>" in function.__qualname__:
        raise ValueError(f"run_isolated needs a module-level function, not {function.__qualname__}")
    return function.__module__, path, function.__qualname__


def signal_death(what: str, returncode: int | None) -> str | None:
    """``"WHAT died with SIGNAME (description): cause"`` for a child that ``returncode`` (subprocess's: minus the
    signal) says a signal ended; None for an exit."""
    return NativeCrash(what, -returncode).render() if returncode is not None and returncode < 0 else None


def run_isolated(function: Callable, *args: Any, what: str = "native code", timeout: float | None = None,
                 sigill_fix: str | None = None, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` in a fresh interpreter: its result, its exception, or :class:`NativeCrash`
    (``sigill_fix``: what it tells the user to do when the child died of SIGILL)."""
    target = _locate(function)
    root = str(Path(__file__).resolve().parents[1])  # the directory holding the orbitctl package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory(prefix="orbitctl-isolated-") as work:
        request, reply, stderr_path = Path(work, "request.pkl"), Path(work, "reply.pkl"), Path(work, "stderr.txt")
        request.write_bytes(pickle.dumps((target, args, kwargs)))
        with open(stderr_path, "w+b") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "orbitctl.isolated", str(request), str(reply)],
                                    stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                stderr.seek(0)
                raise NativeCrash(what, None, stderr_tail=_tail(stderr.read()), timeout=timeout) from None
            except BaseException:  # KeyboardInterrupt: the child goes with the caller
                proc.kill()
                proc.wait()
                raise
            stderr.seek(0)
            tail = _tail(stderr.read())
        if code < 0:
            raise NativeCrash(what, -code, stderr_tail=tail, sigill_fix=sigill_fix)
        if not reply.exists():
            raise OrbitError(f"{what} exited with code {code} before returning a result: {_last_line(tail) or 'no output'}")
        status, payload, child_traceback = pickle.loads(reply.read_bytes())
    try:
        value = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - a class the caller cannot import, or an exception that does not rebuild
        last = _last_line(child_traceback) or f"{type(exc).__name__}: {exc}"
        raise OrbitError(f"{what} {'returned a result that does not load here' if status == 'ok' else 'failed'}: "
                         f"{last}") from None
    if status == "ok":
        return value
    if isinstance(value, BaseException):
        value.child_traceback = child_traceback
        raise value
    raise OrbitError(f"{what} failed: {value}")  # an exception that did not pickle: its text


def _tail(data: bytes, lines: int = 40) -> str:
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _load(module_name: str, path: str | None, qualname: str) -> Callable:
    import importlib
    import importlib.util

    module = None
    if module_name != "__main__":
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
    if module is None:
        if path is None:
            raise ImportError(f"cannot import {module_name} in the child, and it has no file")
        spec = importlib.util.spec_from_file_location(f"_orbitctl_isolated_{Path(path).stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child(request: str, reply: str) -> int:
    import faulthandler
    import traceback

    faulthandler.enable()  # a fatal signal prints the Python stack first, then the child dies of that same signal
    (module_name, path, qualname), args, kwargs = pickle.loads(Path(request).read_bytes())
    try:
        result = ("ok", pickle.dumps(_load(module_name, path, qualname)(*args, **kwargs)), "")
    except BaseException as exc:  # noqa: BLE001 - handed back to the caller as it is
        text = traceback.format_exc()
        try:
            result = ("error", pickle.dumps(exc), text)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            result = ("error", pickle.dumps(f"{type(exc).__name__}: {exc}"), text)
    tmp = Path(reply + ".tmp")
    tmp.write_bytes(pickle.dumps(result))  # the value pickled apart: a reply that cannot rebuild it still loads
    tmp.rename(reply)  # whole or absent: a child killed while writing leaves no reply
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
